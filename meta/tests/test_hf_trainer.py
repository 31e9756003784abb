"""fk.hf with the ``transformers`` Trainer and TRL's ``SFTTrainer``: ``fk.hf.FkCallback`` and
``fk.hf.model_init``.

Each test trains a tiny random-init llama (test_hf_patching.py's) for a few steps, stock and with
fk, from the trainer's seed, and compares the losses the trainer logged at every step, in fp32; on
a CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fk.hf
import fk.hf.loss_head
import fk.lora
import fk.lora.patching

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_api import LORA_TARGETS, _peft_model_of  # noqa: E402
from test_hf_patching import VOCAB, _expected_counts, _model  # noqa: E402

STEPS = 2
LOSS_TOL = {"rel": 1e-5, "abs": 1e-5}
LORA_COUNTS = {**_expected_counts("llama"), "swiglu": 0, "qkv": 0, "lora": 6}  # fk.lora fuses the LoRA MLPs


def _dataset(n: int = 8, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    """Token rows whose scored labels differ in number (a prompt of 0 to 10 tokens not scored), so
    that averaging per micro-batch and over the accumulated batch give different losses."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=gen)
        labels = ids.clone()
        labels[: (3 * i) % 11] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _args(output_dir: Path, device: str, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "per_device_train_batch_size": 2, "max_steps": STEPS, "logging_steps": 1, "learning_rate": 1e-2,
        "report_to": [], "save_strategy": "no", "disable_tqdm": True, "use_cpu": device == "cpu",
    }  # fmt: skip
    options.update(overrides)
    return transformers.TrainingArguments(output_dir=str(output_dir), **options)


def _replicas(trainer: Any) -> int:
    """Model replicas per step: the Trainer wraps the model in ``nn.DataParallel`` when one process
    sees several GPUs (each replica then calls the loss on its slice of the batch)."""
    return max(1, trainer.args.n_gpu)


def _losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _train(model: Any, output_dir: Path, device: str, callbacks: list[Any] | None = None, **args: Any) -> Any:
    trainer = transformers.Trainer(
        model=model, args=_args(output_dir, device, **args), train_dataset=_dataset(), callbacks=callbacks
    )
    trainer.train()
    assert len(_losses(trainer)) == STEPS
    return trainer


@pytest.fixture
def fused_calls(monkeypatch: Any) -> list[dict[str, Any]]:
    """Every call of fk.hf's fused causal-LM loss in grad mode: its labels, ``num_items_in_batch``
    and whether autocast was on. (The probe's call at patch time, under ``torch.no_grad``, is not
    a training step's.)"""
    calls: list[dict[str, Any]] = []
    fused = fk.hf.loss_head.fused_causal_lm_loss

    def spy(hidden_states: torch.Tensor, lm_head: Any, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return fused(hidden_states, lm_head, labels, **kwargs)
        autocast = torch.is_autocast_enabled(hidden_states.device.type)
        calls.append({"labels": labels, "num_items_in_batch": kwargs.get("num_items_in_batch"), "autocast": autocast})
        return fused(hidden_states, lm_head, labels, **kwargs)

    monkeypatch.setattr(fk.hf.loss_head, "fused_causal_lm_loss", spy)
    return calls


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_with_callback_matches_stock(
    accumulation: int, device: str, tmp_path: Path, fused_calls: list[dict[str, Any]]
) -> None:
    """``callbacks=[fk.hf.FkCallback()]``: the model is patched, every micro-batch's loss comes from
    fk's fused loss, and the logged per-step losses and the final weights are stock's. With
    gradient accumulation, each micro-batch's loss is divided by the scored labels of the whole
    accumulated batch (the Trainer's ``num_items_in_batch``), as stock's is."""
    stock = _train(_model("llama", device), tmp_path / "stock", device, gradient_accumulation_steps=accumulation)
    assert not fused_calls
    callback = fk.hf.FkCallback()
    patched = _train(
        _model("llama", device), tmp_path / "fk", device, [callback], gradient_accumulation_steps=accumulation
    )
    assert callback.patched == fk.hf.patched_modules(patched.model) == _expected_counts("llama")
    calls = accumulation * _replicas(patched)  # fused-loss calls per optimizer step
    assert len(fused_calls) == STEPS * calls
    for step in range(STEPS):
        window = fused_calls[step * calls : (step + 1) * calls]
        scored = sum(int((call["labels"][:, 1:] != -100).sum()) for call in window)
        assert [int(call["num_items_in_batch"]) for call in window] == [scored] * calls
    assert _losses(patched) == pytest.approx(_losses(stock), **LOSS_TOL)
    for (name, want), got in zip(stock.model.state_dict().items(), patched.model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_trainer_with_callback_under_mixed_precision(
    device: str, tmp_path: Path, fused_calls: list[dict[str, Any]]
) -> None:
    """``bf16=True``: accelerate wraps the model's forward in autocast when the Trainer prepares it;
    patched before that, the wrapper runs fk's forward, so the fused loss still computes every
    step's loss, under the autocast state stock's LM head sees, close to stock's in bf16."""
    stock_model = _model("llama", device)
    stock_autocast: list[bool] = []  # what stock's LM head sees (a pre-hook; DataParallel replicas keep it)
    stock_model.lm_head.register_forward_pre_hook(
        lambda module, args: stock_autocast.append(torch.is_autocast_enabled(args[0].device.type))
    )
    stock = _train(stock_model, tmp_path / "stock", device, bf16=True)
    patched = _train(_model("llama", device), tmp_path / "fk", device, [fk.hf.FkCallback()], bf16=True)
    assert fk.hf.patched_modules(patched.model) == _expected_counts("llama")
    assert len(fused_calls) == len(stock_autocast) == STEPS * _replicas(patched)
    assert sorted(call["autocast"] for call in fused_calls) == sorted(stock_autocast)
    if _replicas(patched) == 1:
        # One device: the Trainer's forward runs under autocast. (Under nn.DataParallel, on a 2x H200
        # with transformers 5.23, fk's loss ran without it in the replicas' threads; the check above
        # holds fk to whatever stock's LM head sees there.)
        assert all(stock_autocast)
    assert _losses(patched) == pytest.approx(_losses(stock), rel=1e-2)


def test_trainer_with_callback_on_a_peft_model(device: str, tmp_path: Path, caplog: Any) -> None:
    """A PEFT model through the Trainer, with activation checkpointing: fk.lora fuses the LoRA
    layers (no fallback to PEFT's forward), and the losses and trained LoRA weights are stock PEFT's."""
    stock = _train(_peft_model_of(_model("llama", device)), tmp_path / "stock", device, activation_checkpointing=True)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        patched = _train(
            _peft_model_of(_model("llama", device)), tmp_path / "fk", device, [fk.hf.FkCallback()],
            activation_checkpointing=True,
        )  # fmt: skip
    assert fk.hf.patched_modules(patched.model) == LORA_COUNTS and fk.lora.is_patched(patched.model)
    assert "runs PEFT's forward" not in caplog.text
    assert _losses(patched) == pytest.approx(_losses(stock), **LOSS_TOL)
    want = {n: p for n, p in stock.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in patched.model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    for name, param in want.items():
        torch.testing.assert_close(got[name], param, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _tokenizer() -> Any:
    """A word-level tokenizer over the tiny models' vocabulary (``t0`` ... ``t299``), built in memory."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="t0", unk_token="t1", eos_token="t2"
    )


def _sft_dataset() -> Any:
    """Tokenized rows of 10 to 16 tokens (padded in a batch) whose first 0 to 3 tokens are a prompt
    (``completion_mask`` 0: not scored)."""
    import datasets

    gen = torch.Generator().manual_seed(3)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "completion_mask": []}
    for i in range(8):
        n, prompt = 10 + (5 * i) % 7, i % 4
        rows["input_ids"].append(torch.randint(3, VOCAB, (n,), generator=gen).tolist())
        rows["completion_mask"].append([0] * prompt + [1] * (n - prompt))
    return datasets.Dataset.from_dict(rows)


def test_sft_trainer_with_peft_config(
    device: str, tmp_path: Path, fused_calls: list[dict[str, Any]], monkeypatch: Any
) -> None:
    """TRL's ``SFTTrainer`` given ``peft_config`` builds the PEFT model itself; the callback still
    sees that model and fk.lora fuses its LoRA layers (they run in training), the base's norms and
    rotary embedding are fk's. The training loss stays TRL's own fused LM head's (with its entropy
    and accuracy metrics), which fk leaves in place: the logged losses are stock SFTTrainer's."""
    pytest.importorskip("datasets", reason="TRL's SFTTrainer needs `datasets` (fk-hf[testing] brings it)")
    trl = pytest.importorskip("trl", reason="needs TRL (`pip install trl`; fk-hf[testing] brings it)")
    peft = pytest.importorskip("peft")
    fused_mlp = fk.lora.patching.module_mlp
    mlp_calls = []
    monkeypatch.setattr(fk.lora.patching, "module_mlp", lambda *a, **k: mlp_calls.append(1) or fused_mlp(*a, **k))

    def train(callbacks: list[Any]) -> Any:
        args = trl.SFTConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1,
            learning_rate=1e-2, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=device == "cpu",
            bf16=False,
        )  # fmt: skip
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
        trainer = trl.SFTTrainer(
            model=_model("llama", device), args=args, train_dataset=_sft_dataset(), processing_class=_tokenizer(),
            peft_config=lora, callbacks=callbacks,
        )  # fmt: skip
        trainer.train()
        return trainer

    stock = train([])
    assert not mlp_calls
    patched = train([fk.hf.FkCallback()])
    assert isinstance(patched.model, peft.PeftModel) and fk.lora.is_patched(patched.model)
    assert fk.hf.patched_modules(patched.model) == LORA_COUNTS
    assert len(mlp_calls) >= STEPS * 2  # both layers' LoRA MLPs, every step
    assert not fused_calls  # TRL's fused LM head computed the loss
    logged = [entry for entry in patched.state.log_history if "loss" in entry]
    assert len(logged) == STEPS and all("mean_token_accuracy" in entry for entry in logged)
    assert _losses(patched) == pytest.approx(_losses(stock), **LOSS_TOL)


def test_model_init_hook(device: str, tmp_path: Path, fused_calls: list[dict[str, Any]]) -> None:
    """``Trainer(model_init=fk.hf.model_init(make_model))``: the model ``train()`` builds is
    patched and trains as the stock function's model does. The wrapper keeps the function's
    signature (the Trainer passes the trial to a one-argument init)."""

    def make_model() -> Any:
        return _model("llama", device)

    losses = {}
    for name, init in (("stock", make_model), ("fk", fk.hf.model_init(make_model))):
        trainer = transformers.Trainer(model_init=init, args=_args(tmp_path / name, device), train_dataset=_dataset())
        trainer.train()
        losses[name] = _losses(trainer)
    assert fk.hf.patched_modules(trainer.model) == _expected_counts("llama")
    assert len(fused_calls) == STEPS * _replicas(trainer)
    assert losses["fk"] == pytest.approx(losses["stock"], **LOSS_TOL)
    with_trial = fk.hf.model_init(lambda trial: _model("llama", device), flce=False)
    assert list(inspect.signature(with_trial).parameters) == ["trial"]
    assert fk.hf.patched_modules(with_trial(None)) == {**_expected_counts("llama"), "flce": 0}


def test_callback_switches_late_callback_and_errors(device: str, tmp_path: Path) -> None:
    """The callback's switches reach ``fk.hf.apply``; a callback added after the trainer was built
    patches when training begins; unknown switches raise ``TypeError`` before any model is touched."""
    trainer = transformers.Trainer(
        model=_model("llama", device), args=_args(tmp_path, device, max_steps=1), train_dataset=_dataset()
    )
    callback = fk.hf.FkCallback(flce=False, rope=False)
    trainer.add_callback(callback)
    assert callback.patched is None
    trainer.train()
    assert (
        callback.patched == fk.hf.patched_modules(trainer.model) == {**_expected_counts("llama"), "flce": 0, "rope": 0}
    )
    with pytest.raises(TypeError, match=r"unknown fk\.hf switch.*rms_nrom"):
        fk.hf.FkCallback(rms_nrom=False)
    with pytest.raises(TypeError, match="rope must be a bool"):
        fk.hf.model_init(lambda: None, rope=1)  # type: ignore[arg-type]
    assert issubclass(fk.hf.FkCallback, transformers.TrainerCallback)
