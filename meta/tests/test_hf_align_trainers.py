"""fk.hf with TRL's DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer and GKDTrainer: ``fk.hf.align_trainer``.

Each test trains a tiny random-init llama (test_hf_patching.py's) for a few steps with the stock
trainer and with ``fk.hf.align_trainer`` from the same seed, and compares every logged number
(the loss and TRL's metrics) at every step in fp32, with a spy on the fk-align loss proving fk's
path computed each step's loss. On a CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fk.align
import fk.hf
from fk.hf import training

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets", reason="TRL's trainers need `datasets` (fk-hf[testing] brings it)")
trl = pytest.importorskip("trl", reason="needs TRL (`pip install trl`; fk-hf[testing] brings it)")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_patching import VOCAB, _expected_counts, _model  # noqa: E402

STEPS = 2
TOL = {"rel": 1e-4, "abs": 1e-5}
UNTIMED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")


def _tokenizer() -> Any:
    """A whitespace-split word-level tokenizer over the tiny models' vocabulary (``t3`` ... ``t299``)."""
    return training.word_tokenizer(VOCAB)


def _words(gen: torch.Generator, n: int) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=gen))


def _config(cls: Any, output_dir: Path, device: str, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "per_device_train_batch_size": 2, "max_steps": STEPS, "logging_steps": 1, "learning_rate": 1e-2,
        "report_to": [], "save_strategy": "no", "disable_tqdm": True, "use_cpu": device == "cpu", "bf16": False,
        "seed": 7,
    }  # fmt: skip
    options.update(overrides)
    return cls(output_dir=str(output_dir), **options)


def _logs(trainer: Any) -> list[dict[str, float]]:
    """The per-step log entries, without the timings."""
    return [
        {k: v for k, v in entry.items() if k not in UNTIMED} for entry in trainer.state.log_history if "loss" in entry
    ]


def _assert_same_logs(patched: Any, stock: Any) -> None:
    got, want = _logs(patched), _logs(stock)
    assert len(want) == STEPS and [e.keys() for e in got] == [e.keys() for e in want]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in w:
            if isinstance(w[key], float) and math.isnan(w[key]):
                assert math.isnan(g[key]), f"step {step} {key}"
            else:
                assert g[key] == pytest.approx(w[key], **TOL), f"step {step} {key}: {g[key]} != {w[key]}"


@pytest.fixture
def spy(monkeypatch: Any) -> dict[str, int]:
    """Calls of each fk-align loss in grad mode (training steps)."""
    calls: dict[str, int] = {}
    for name in ("fused_linear_dpo_loss", "fused_linear_kto_loss", "fused_linear_grpo_loss", "fused_linear_rloo_loss",
                 "fused_linear_distill_from_logits"):  # fmt: skip
        fused = getattr(fk.align, name)

        def wrapper(*args: Any, _fused: Any = fused, _name: str = name, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                calls[_name] = calls.get(_name, 0) + 1
            return _fused(*args, **kwargs)

        monkeypatch.setattr(fk.align, name, wrapper)
    return calls


def _perturbed(device: str) -> Any:
    """The tiny llama with every weight moved a little: a DPO reference or a GKD teacher that
    differs from the policy from the first step (no reward ties at 0)."""
    model = _model("llama", device)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen).to(param.device))
    return model


# --- DPO ------------------------------------------------------------------------------------------


def _dpo_dataset() -> Any:
    import datasets

    gen = torch.Generator().manual_seed(3)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(8):
        rows["prompt"].append(_words(gen, 2 + i % 3))
        rows["chosen"].append(" " + _words(gen, 3 + i % 4))
        rows["rejected"].append(" " + _words(gen, 2 + (i * 3) % 5))
    return datasets.Dataset.from_dict(rows)


def _train_dpo(
    tmp_path: Path, device: str, fk_on: bool, peft_config: Any = None, callbacks: Any = None, **overrides: Any
) -> Any:
    args = _config(trl.DPOConfig, tmp_path / ("fk" if fk_on else "stock"), device, **overrides)
    trainer = trl.DPOTrainer(
        model=_model("llama", device), ref_model=None if peft_config else _perturbed(device), args=args,
        train_dataset=_dpo_dataset(), processing_class=_tokenizer(), peft_config=peft_config, callbacks=callbacks,
    )  # fmt: skip
    if fk_on:
        assert fk.hf.align_trainer(trainer) is trainer
    trainer.train()
    return trainer


def test_dpo_trainer_matches_stock(device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """``fk.hf.align_trainer(DPOTrainer(...))``: every step's loss comes from
    ``fk.align.fused_linear_dpo_loss`` on the patched model, and the logged loss and metrics
    (rewards, log-probs, entropy, mean logits, token accuracy) are stock DPO's, here for a
    weighted mix of loss types (``sigmoid`` alone: the PEFT test below)."""
    options = {"loss_type": ["sigmoid", "ipo", "sft"], "loss_weights": [1.0, 0.5, 0.2]}
    stock = _train_dpo(tmp_path, device, False, **options)
    assert not spy
    patched = _train_dpo(tmp_path, device, True, **options)
    assert spy == {"fused_linear_dpo_loss": STEPS}
    assert patched.__dict__["_fk_align"] == "dpo"
    counts = fk.hf.patched_modules(patched.model)
    assert counts["rms_norm"] == _expected_counts("llama")["rms_norm"] and counts["swiglu"] > 0
    ref_counts = fk.hf.patched_modules(patched.ref_model)  # the reference's blocks too, not its head
    assert ref_counts["rms_norm"] == counts["rms_norm"] and ref_counts["swiglu"] == counts["swiglu"]
    assert ref_counts["flce"] == 0 and not any(fk.hf.patched_modules(stock.ref_model).values())
    assert "rewards/margins" in _logs(patched)[0] and "mean_token_accuracy" in _logs(patched)[0]
    _assert_same_logs(patched, stock)


def test_dpo_trainer_with_peft_config(device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """DPO of a LoRA adapter TRL adds from ``peft_config``, its reference the model with the adapter
    off: fk.lora fuses the LoRA layers, fk-align computes the loss, and the logs are stock's. The
    model was patched by an ``FkCallback`` given to the same trainer: ``align_trainer`` keeps that
    patch (and its switches) and only takes the loss."""
    peft = pytest.importorskip("peft")
    from test_hf_api import LORA_TARGETS

    def lora() -> Any:
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)

    stock = _train_dpo(tmp_path, device, False, peft_config=lora())
    callback = fk.hf.FkCallback(rope=False)
    patched = _train_dpo(tmp_path, device, True, peft_config=lora(), callbacks=[callback])
    assert isinstance(patched.model, peft.PeftModel) and fk.hf.patched_modules(patched.model)["lora"] > 0
    assert callback.patched is not None and fk.hf.patched_modules(patched.model)["rope"] == 0
    assert spy == {"fused_linear_dpo_loss": STEPS}
    _assert_same_logs(patched, stock)


def test_dpo_unsupported_setting_falls_back_with_one_warning(device: str, tmp_path: Path, caplog: Any) -> None:
    """A setting fk-align does not compute (here WPO's ``use_weighting``) leaves DPO's own loss in
    place, with one warning naming it; the model is patched all the same."""
    args = _config(trl.DPOConfig, tmp_path, device, use_weighting=True)
    trainer = trl.DPOTrainer(model=_model("llama", device), ref_model=_perturbed(device), args=args,
                             train_dataset=_dpo_dataset(), processing_class=_tokenizer())  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fk.hf"):
        fk.hf.align_trainer(trainer)
    assert trainer.__dict__["_fk_align"] is None and "_compute_loss" not in trainer.__dict__
    assert [r.getMessage() for r in caplog.records if "use_weighting=True" in r.getMessage()]
    assert any(fk.hf.patched_modules(trainer.model).values())
    with pytest.raises(TypeError, match="DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer or GKDTrainer"):
        fk.hf.align_trainer(transformers.Trainer(model=_model("llama", device), args=_config(
            transformers.TrainingArguments, tmp_path, device)))  # fmt: skip
    with pytest.raises(TypeError, match=r"unknown fk\.hf switch"):
        fk.hf.align_trainer(trainer, rms_nrom=False)


# --- KTO ------------------------------------------------------------------------------------------


def _kto_dataset() -> Any:
    """Unpaired completions, five desirable and three not (a batch of 2 may hold one kind only)."""
    import datasets

    gen = torch.Generator().manual_seed(6)
    rows: dict[str, list[Any]] = {"prompt": [], "completion": [], "label": []}
    for i in range(8):
        rows["prompt"].append(_words(gen, 2 + i % 3))
        rows["completion"].append(" " + _words(gen, 2 + (i * 5) % 4))
        rows["label"].append(i % 3 != 2)
    return datasets.Dataset.from_dict(rows)


def _train_kto(tmp_path: Path, device: str, fk_on: bool, peft_config: Any = None, **overrides: Any) -> Any:
    args = _config(trl.KTOConfig, tmp_path / ("fk" if fk_on else "stock"), device, **overrides)
    trainer = trl.KTOTrainer(
        model=_model("llama", device), ref_model=None if peft_config else _perturbed(device), args=args,
        train_dataset=_kto_dataset(), processing_class=_tokenizer(), peft_config=peft_config,
    )  # fmt: skip
    if fk_on:
        assert fk.hf.align_trainer(trainer) is trainer
    trainer.train()
    return trainer


KTO_OPTIONS = [
    {"per_device_train_batch_size": 4},  # kto with its KL estimate (TRL's needs batches of 2 or more)
    {"loss_type": "apo_zero_unpaired", "desirable_weight": 1.5, "undesirable_weight": 0.7},  # no KL
]


@pytest.mark.parametrize("options", KTO_OPTIONS)
def test_kto_trainer_matches_stock(options: dict[str, Any], device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """``fk.hf.align_trainer(KTOTrainer(...))``: every step's loss comes from
    ``fk.align.fused_linear_kto_loss`` on the patched model, and the logged loss and metrics (KL,
    rewards, log-probs, entropy, mean logits, token count) are stock KTO's, with the KL estimate
    and without (``apo_zero_unpaired``, weighted)."""
    stock = _train_kto(tmp_path, device, False, **options)
    assert not spy
    patched = _train_kto(tmp_path, device, True, **options)
    assert spy == {"fused_linear_kto_loss": STEPS}
    assert patched.__dict__["_fk_align"] == "kto"
    ref_counts = fk.hf.patched_modules(patched.ref_model)
    assert ref_counts["rms_norm"] > 0 and ref_counts["flce"] == 0
    logs = _logs(patched)
    assert "entropy" in logs[0] and "kl" in logs[0]
    assert any(e["kl"] != 0.0 for e in logs) == (options.get("loss_type", "kto") == "kto")
    _assert_same_logs(patched, stock)


def test_kto_trainer_with_peft_config(device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """KTO of a LoRA adapter TRL adds from ``peft_config``, its reference the model with the adapter
    off: fk.lora fuses the LoRA layers, fk-align computes the loss, and the logs are stock's."""
    peft = pytest.importorskip("peft")
    from test_hf_api import LORA_TARGETS

    def lora() -> Any:
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)

    options = {"per_device_train_batch_size": 4}
    stock = _train_kto(tmp_path, device, False, peft_config=lora(), **options)
    patched = _train_kto(tmp_path, device, True, peft_config=lora(), **options)
    assert isinstance(patched.model, peft.PeftModel) and fk.hf.patched_modules(patched.model)["lora"] > 0
    assert spy == {"fused_linear_kto_loss": STEPS}
    _assert_same_logs(patched, stock)


# --- GRPO -----------------------------------------------------------------------------------------


def _reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A dummy reward: the sum of the completion's token numbers, scaled."""
    return [sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) / 100.0 for c in completions]


def _grpo_dataset() -> Any:
    import datasets

    gen = torch.Generator().manual_seed(4)
    return datasets.Dataset.from_dict({"prompt": [_words(gen, 3 + i % 2) for i in range(8)]})


def _train_grpo(model_dir: Path, tmp_path: Path, device: str, fk_on: bool, kind: str = "grpo",
                peft_config: Any = None, **overrides: Any) -> Any:  # fmt: skip
    """Train GRPO (``kind="rloo"``: RLOO, whose data and generation are GRPO's)."""
    config_class, trainer_class = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig,
                                                                                             trl.RLOOTrainer)  # fmt: skip
    options = {"num_generations": 2, "max_completion_length": 3, "beta": 0.05, **overrides}
    args = _config(config_class, tmp_path / ("fk" if fk_on else "stock"), device, **options)
    trainer = trainer_class(model=str(model_dir), reward_funcs=_reward, args=args, train_dataset=_grpo_dataset(),
                            processing_class=_tokenizer(), peft_config=peft_config)  # fmt: skip
    if fk_on:
        fk.hf.align_trainer(trainer)
    trainer.train()
    return trainer


GRPO_OPTIONS = [
    {},  # dapo, on-policy (ratio 1)
    {"loss_type": "grpo", "entropy_coef": 0.01},  # the entropy bonus, and its policy_loss metric
    # a second step on the first step's generations: old log-probs, ratios away from 1, clipped
    {"loss_type": "bnpo", "num_iterations": 2, "epsilon": 0.002, "importance_sampling_level": "sequence"},
    {"loss_type": "cispo", "num_iterations": 2, "epsilon_high": 1.001, "beta": 0.0},
]


@pytest.mark.parametrize("options", GRPO_OPTIONS)
def test_grpo_trainer_matches_stock(options: dict[str, Any], device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """``fk.hf.align_trainer(GRPOTrainer(...))``: TRL generates and scores the completions as
    stock (the same from the same seed), every step's loss comes from
    ``fk.align.fused_linear_grpo_loss``, and the logged loss, KL, entropy, clip ratios (and the
    entropy bonus' policy loss) are stock GRPO's. With a KL term, so the reference model is used."""
    model_dir = tmp_path / "model"
    _model("llama", "cpu").save_pretrained(model_dir)
    stock = _train_grpo(model_dir, tmp_path, device, False, **options)
    assert not spy
    patched = _train_grpo(model_dir, tmp_path, device, True, **options)
    assert spy == {"fused_linear_grpo_loss": STEPS}
    assert patched.__dict__["_fk_align"] == "grpo" and any(fk.hf.patched_modules(patched.model).values())
    assert ("kl" in _logs(patched)[0]) == (options.get("beta", 0.05) != 0.0)
    _assert_same_logs(patched, stock)


# --- RLOO -----------------------------------------------------------------------------------------


RLOO_OPTIONS = [
    {},  # on-policy, the KL penalty in the reward (the reference model runs)
    # a second step on the first step's generations: ratios away from 1, clipped on both sides
    {"num_iterations": 2, "epsilon": 0.002, "temperature": 0.7, "beta": 0.0},
]


@pytest.mark.parametrize("options", RLOO_OPTIONS)
def test_rloo_trainer_matches_stock(options: dict[str, Any], device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """``fk.hf.align_trainer(RLOOTrainer(...))``: TRL generates and scores the completions as
    stock, every step's loss comes from ``fk.align.fused_linear_rloo_loss``, and the logged loss,
    entropy and clip ratios are stock RLOO's."""
    model_dir = tmp_path / "model"
    _model("llama", "cpu").save_pretrained(model_dir)
    stock = _train_grpo(model_dir, tmp_path, device, False, "rloo", **options)
    assert not spy
    patched = _train_grpo(model_dir, tmp_path, device, True, "rloo", **options)
    assert spy == {"fused_linear_rloo_loss": STEPS}
    assert patched.__dict__["_fk_align"] == "rloo" and any(fk.hf.patched_modules(patched.model).values())
    _assert_same_logs(patched, stock)
    if options.get("num_iterations"):
        assert any(entry["clip_ratio/region_mean"] > 0 for entry in _logs(stock))


def test_rloo_trainer_with_peft_config(device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """RLOO of a LoRA adapter TRL adds from ``peft_config``, the KL penalty's reference the model
    with the adapter off: fk.lora fuses the LoRA layers, fk-align computes the loss, and the logs
    are stock's."""
    peft = pytest.importorskip("peft")
    from test_hf_api import LORA_TARGETS

    def lora() -> Any:
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)

    model_dir = tmp_path / "model"
    _model("llama", "cpu").save_pretrained(model_dir)
    stock = _train_grpo(model_dir, tmp_path, device, False, "rloo", peft_config=lora())
    patched = _train_grpo(model_dir, tmp_path, device, True, "rloo", peft_config=lora())
    assert isinstance(patched.model, peft.PeftModel) and fk.hf.patched_modules(patched.model)["lora"] > 0
    assert spy == {"fused_linear_rloo_loss": STEPS}
    _assert_same_logs(patched, stock)


# --- GKD ------------------------------------------------------------------------------------------


def _gkd_rows() -> Any:
    import datasets

    gen = torch.Generator().manual_seed(5)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for i in range(8):
        n, prompt = 10 + (5 * i) % 7, 2 + i % 4
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return datasets.Dataset.from_dict(rows)


def _collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-padded token ids, attention mask and labels (-100 on the prompt and padding)."""
    width = max(len(r["input_ids"]) for r in rows)
    pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
    ids = torch.tensor(pad([r["input_ids"] for r in rows], 0))
    mask = torch.tensor(pad([[1] * len(r["input_ids"]) for r in rows], 0))
    labels = torch.tensor(pad([r["labels"] for r in rows], -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train_gkd(tmp_path: Path, device: str, fk_on: bool, **overrides: Any) -> Any:
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    options = {"lmbda": 0.0, "seq_kd": False, "max_length": 32, **overrides}
    args = _config(GKDConfig, tmp_path / ("fk" if fk_on else "stock"), device, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GKDTrainer(model=_model("llama", device), teacher_model=_perturbed(device), args=args,
                             data_collator=_collate, train_dataset=_gkd_rows(), processing_class=_tokenizer())  # fmt: skip
    if fk_on:
        fk.hf.align_trainer(trainer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("beta", [0.5, 0.0])
def test_gkd_trainer_matches_stock(beta: float, device: str, tmp_path: Path, spy: dict[str, int]) -> None:
    """``fk.hf.align_trainer(GKDTrainer(...))`` (off-policy batches, ``lmbda=0``): every step's
    loss comes from ``fk.align.fused_linear_distill_from_logits`` against the teacher's logits,
    without the student's, and equals stock GKD's generalized JSD (``beta=0``: forward KL), with
    gradient accumulation's ``num_items_in_batch`` as the divisor."""
    options = {"beta": beta, "gradient_accumulation_steps": 2}
    stock = _train_gkd(tmp_path, device, False, **options)
    assert not spy
    patched = _train_gkd(tmp_path, device, True, **options)
    assert spy == {"fused_linear_distill_from_logits": 2 * STEPS}
    assert patched.__dict__["_fk_align"] == "gkd" and any(fk.hf.patched_modules(patched.model).values())
    teacher = fk.hf.patched_modules(patched.teacher_model)
    assert teacher["rms_norm"] > 0 and teacher["flce"] == 0
    _assert_same_logs(patched, stock)
