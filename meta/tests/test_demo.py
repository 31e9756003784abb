"""The training demo (fk.hf.demo) and the helpers it shares with benchmarks/bench_e2e.py (fk.hf.training)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fk.hf import demo, training


def test_corpus_is_deterministic_and_follows_its_chain() -> None:
    corpus = training.MarkovCorpus(vocab=512, active=32, branching=2, seed=3)
    tokens = corpus.batch(step=5, batch=3, seq=40)
    assert tokens.shape == (3, 40) and tokens.dtype == torch.long
    assert torch.equal(tokens, training.MarkovCorpus(512, 32, 2, seed=3).batch(5, 3, 40))
    assert not torch.equal(tokens, corpus.batch(6, 3, 40))
    assert int(tokens.max()) < 32
    for row in tokens:
        for prev, nxt in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
            assert nxt in corpus.successors[prev].tolist()
    assert corpus.floor == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="active"):
        training.MarkovCorpus(vocab=8, active=16)


def test_word_tokenizer_maps_word_ti_to_token_i_and_back() -> None:
    pytest.importorskip("transformers")
    tokenizer = training.word_tokenizer(128256)
    ids = tokenizer("t5 t128255  t3\nt99999")["input_ids"]
    assert ids == [5, 128255, 3, 99999]  # one token a word, nothing added around the text
    assert tokenizer("t12 t21 t120")["input_ids"] == [12, 21, 120]  # no special token cut out of a word
    assert tokenizer.decode([7, 128255, 2], skip_special_tokens=True) == "t7 t128255"  # 2 ends a sequence
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (0, 2, 128256)


@pytest.mark.parametrize("tied", [True, False])
def test_shape_counts_the_parameters_of_the_model_it_builds(tied: bool) -> None:
    shape = training.ModelShape(hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=100,
                                tie_word_embeddings=tied)  # fmt: skip
    model = training.build_model(shape, dtype=torch.float32, device="cpu", seed=0, max_positions=16)
    assert sum(p.numel() for p in model.parameters()) == shape.parameters()
    again = training.build_model(shape, dtype=torch.float32, device="cpu", seed=0, max_positions=16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    assert model.training


def test_lora_model_trains_only_its_adapters() -> None:
    pytest.importorskip("peft")
    model = training.build_model(training.SHAPES["tiny"], dtype=torch.bfloat16, device="cpu", lora=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    targets = {n.split(".")[-4] for n in trainable if n.endswith("lora_A.default.weight")}
    assert targets == set(training.LORA_TARGETS)


def test_demo_trains_stock_and_fk_to_the_same_losses(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--steps", "3", "--no-plot"]) == 0
    out = capsys.readouterr().out
    memory = "peak memory" if torch.cuda.is_available() else "saved for backward"  # (the GPU's demo: CUDA's peak)
    assert "losses agree" in out and memory in out and "tokens/s" in out


def test_demo_lora(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    assert demo.main(["--lora", "--steps", "2", "--no-plot"]) == 0
    assert "PEFT LoRA" in capsys.readouterr().out


def _fake(losses: list[float]) -> training.RunResult:
    return training.RunResult(losses=losses, step_seconds=[0.1] * len(losses), tokens_per_step=64, peak_bytes=2**30,
                              saved_bytes=2**20)  # fmt: skip


def test_demo_fails_when_the_losses_disagree(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {"stock": _fake([5.0, 4.0, 3.0]), "fk": _fake([5.0, 4.0, 3.5])}
    monkeypatch.setattr(demo, "run_one", lambda provider, settings: runs[provider])
    assert demo.main(["--no-plot"]) == 1
    assert "losses DISAGREE" in capsys.readouterr().out
    runs["fk"] = _fake([5.0, 4.0, float("nan")])
    assert demo.main(["--no-plot"]) == 1
    runs["fk"] = _fake([5.0, 4.0, 3.0 + 1e-4])
    assert demo.main(["--no-plot"]) == 0


def test_demo_plot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(demo, "run_one", lambda provider, settings: _fake([5.0, 4.0, 3.0]))
    path = tmp_path / "loss.png"
    assert demo.main(["--plot", str(path)]) == 0
    assert path.stat().st_size > 0


def test_demo_lora_without_peft(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def missing() -> None:
        raise ImportError("LoRA needs peft, which is not installed: pip install peft")

    monkeypatch.setattr(training, "_import_peft", missing)
    assert demo.main(["--lora"]) == 2
    assert "pip install peft" in capsys.readouterr().err
