"""benchmarks/bench_align_e2e.py: a --tiny run of TRL's DPO, KTO, GRPO and RLOO trainers on the CPU
(Triton's interpreter), stock and fk, whose record must show fk's loss computing every step of fk's
runs and none of stock's, TRL's token counts of the tiny sizes, and DPO's and KTO's losses agreeing
with stock's; how
it merges rounds with the training part alone; which modules it counts as Liger's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fk.core import bench, testing

pytest.importorskip("transformers")
pytest.importorskip("datasets", reason="TRL's trainers need `datasets` (fk-hf[testing] brings it)")
pytest.importorskip("trl", reason="needs TRL (`pip install trl`; fk-hf[testing] brings it)")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_align_e2e.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")


@pytest.mark.serial
def test_tiny_run_of_dpo_kto_grpo_and_rloo_through_trl(tmp_path: Path) -> None:
    testing.run_python(str(SCRIPT), "--tiny", "--providers", "stock", "fk", "--steps", "1", "--out", str(tmp_path))
    script = testing.load_script(SCRIPT)
    record = bench.BenchRecord.from_json(tmp_path / "align_e2e.json")
    runs = {(r["trainer"], r["provider"]): r for r in record.rows}
    assert set(runs) == {(kind, provider) for kind in ("dpo", "kto", "grpo", "rloo") for provider in ("stock", "fk")}
    for (kind, provider), run in runs.items():
        sizes = script.TINY_SIZES[kind]
        assert run["status"] == "ok", run["status"]
        assert run["fk_loss_calls"] == (2 if provider == "fk" else 0)  # a warm-up step and a timed one
        assert bool(run["patched"]) == (provider == "fk") and run["liger_modules"] == {}
        sequences = 2 * sizes.batch if kind == "dpo" else sizes.batch  # DPO: chosen and rejected of each pair
        assert run["tokens_per_step"] == sequences * (sizes.prompt + sizes.completion)
    assert runs["dpo", "fk"]["first_loss_diff"] <= script.FIRST_LOSS_TOLERANCE
    assert runs["kto", "fk"]["first_loss_diff"] <= script.FIRST_LOSS_TOLERANCE
    assert abs(runs["dpo", "stock"]["losses"][0] - math.log(2)) < 1e-4  # policy = reference at the first step
    assert abs(runs["kto", "stock"]["losses"][0] - 0.5) < 1e-4  # (1 - sigmoid(0), its KL estimate 0)
    for kind in ("grpo", "rloo"):
        for provider in ("stock", "fk"):
            run = runs[kind, provider]
            assert 0 < run["generation_share"] < 1 and run["train_tokens_per_s"] > run["tokens_per_s"]


def test_rounds_merge_into_whole_steps_and_their_training_part() -> None:
    rounds = [
        {"step_seconds": [2.0, 4.0], "train_seconds": [1.0, 1.0], "generation_seconds": [1.0, 3.0],
         "tokens_per_step": 100, "peak_gib": 5.0, "train_peak_gib": 3.0, "losses": [0.5]},
        {"step_seconds": [3.0], "train_seconds": [2.0], "generation_seconds": [1.0],
         "tokens_per_step": 100, "peak_gib": 4.0, "train_peak_gib": 3.5, "losses": [0.6]},
    ]  # fmt: skip
    merged = testing.load_script(SCRIPT).merge_trainer_rounds(rounds)
    assert merged["tokens_per_s"] == pytest.approx(100 / 3.0) and merged["peak_gib"] == 5.0
    assert merged["train_tokens_per_s"] == pytest.approx(100 / 1.0) and merged["train_peak_gib"] == 3.5
    assert merged["train_round_tokens_per_s"] == pytest.approx([100.0, 50.0])
    assert merged["generation_share"] == pytest.approx(5.0 / 9.0) and merged["losses"] == [0.5]


def test_liger_modules_counts_the_modules_liger_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """What TRL's ``use_liger_kernel=True`` does to a Llama (transformers' ``apply_liger_kernel``
    with TRL's config): Liger's RMSNorm on every norm, its SwiGLU on every MLP, its RoPE."""
    pytest.importorskip("liger_kernel")
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.models.llama import modeling_llama

    from fk.hf import training

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger replaces them for the process
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))

    script = testing.load_script(SCRIPT)
    shape = training.SHAPES["tiny"]
    model = training.build_model(shape, dtype=torch.float32, device="cpu")
    assert not any(script.liger_modules(model).values())
    apply_liger_kernel(model, {"fused_linear_cross_entropy": False})
    counts = script.liger_modules(model)
    assert counts == {"LigerRMSNorm": 2 * shape.layers + 1, "LigerSwiGLUMLP": shape.layers, "rope": 1}
