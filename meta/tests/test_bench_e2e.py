"""benchmarks/bench_e2e.py: how it merges records, and a --tiny run on the CPU (Triton's
interpreter) with two rounds, whose record must hold each round's speed (the rounds' order and
merge are fk.core.bench's: fk-core's test_bench.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fk.core import bench, testing

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_e2e.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")


@pytest.mark.serial
def test_tiny_run_with_two_rounds(tmp_path: Path) -> None:
    testing.run_python(str(SCRIPT), "--tiny", "--layers", "1", "--modes", "full", "--providers", "stock", "fk",
                       "--rounds", "2", "--search-seconds", "0", "--out", str(tmp_path))  # fmt: skip
    record = bench.BenchRecord.from_json(tmp_path / "e2e.json")
    runs = {r["provider"]: r for r in record.rows if r["kind"] == "run"}
    assert set(runs) == {"stock", "fk"}
    assert {r["model"] for r in runs.values()} == {"tiny (1 layers)"} and "1 layers" in record.notes
    for run in runs.values():
        assert run["status"] == "ok" and len(run["round_tokens_per_s"]) == 2
        assert min(run["round_tokens_per_s"]) <= run["tokens_per_s"] <= max(run["round_tokens_per_s"])
        assert [len(steps) for steps in run["round_step_ms"]] == [2, 2]  # each round's timed steps
        assert [len(steps) for steps in run["round_gc_ms"]] == [2, 2]
        for steps, issued in zip(run["round_step_ms"], run["round_host_ms"], strict=True):
            assert len(issued) == 2 and all(0 < h <= s for h, s in zip(issued, steps, strict=True))
    assert runs["fk"]["loss_rel_diff"] < 2e-2
    assert "2 rounds of 2 timed steps" in record.notes


@pytest.mark.serial
@pytest.mark.parametrize(
    ("mode", "described"),
    [("qlora", "qlora: the same on bitsandbytes NF4 bases"),
     ("qlora-recipe", "qlora-recipe: qlora after peft.prepare_model_for_kbit_training")],
)  # fmt: skip
def test_tiny_qlora_run(tmp_path: Path, mode: str, described: str) -> None:
    """``--modes qlora``: PEFT LoRA on bitsandbytes NF4 bases (at ``tiny-qlora``, whole 4-bit blocks),
    fk fusing the LoRA layers on their 4-bit bases, the losses stock's; ``qlora-recipe`` the same
    with fp32 hidden states, dropout and bf16 autocast, every LoRA call fused (no fallback logged)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    testing.run_python(str(SCRIPT), "--tiny", "--modes", mode, "--providers", "stock", "fk",
                       "--search-seconds", "0", "--out", str(tmp_path))  # fmt: skip
    record = bench.BenchRecord.from_json(tmp_path / "e2e.json")
    runs = {r["provider"]: r for r in record.rows if r["kind"] == "run"}
    for run in runs.values():
        assert run["status"] == "ok" and run["mode"] == mode and run["model"] == "tiny-qlora"
    assert runs["fk"]["patched"]["lora"] > 0 and runs["fk"]["loss_rel_diff"] < 2e-2
    assert runs["fk"]["fallbacks"] == []
    assert described in record.notes


@pytest.mark.serial
def test_tiny_lora_recipe_run(tmp_path: Path) -> None:
    """``--modes lora-recipe``: PEFT's fp32 adapters with dropout on the bf16 model under bf16
    autocast, every LoRA call fused (no fallback logged), the losses stock's."""
    pytest.importorskip("peft")
    testing.run_python(str(SCRIPT), "--tiny", "--modes", "lora-recipe", "--providers", "stock", "fk",
                       "--search-seconds", "0", "--out", str(tmp_path))  # fmt: skip
    record = bench.BenchRecord.from_json(tmp_path / "e2e.json")
    runs = {r["provider"]: r for r in record.rows if r["kind"] == "run"}
    assert set(runs) == {"stock", "fk"} and all(r["status"] == "ok" for r in runs.values())
    assert runs["fk"]["patched"]["lora"] > 0 and runs["fk"]["loss_rel_diff"] < 2e-2
    assert runs["fk"]["fallbacks"] == []
    assert "lora-recipe: lora with LoRA dropout 0.05, the forward under bf16 autocast" in record.notes


@pytest.mark.serial
def test_tiny_vision_language_run(tmp_path: Path) -> None:
    """``--family gemma3 qwen2_5_vl``: the vision-language models trained on batches with an image a
    sequence, fk's fused head taking them, the losses stock's."""
    testing.run_python(str(SCRIPT), "--tiny", "--layers", "1", "--family", "gemma3", "qwen2_5_vl", "--modes", "full",
                       "--providers", "stock", "fk", "--search-seconds", "0", "--out", str(tmp_path))  # fmt: skip
    record = bench.BenchRecord.from_json(tmp_path / "e2e.json")
    runs = {(r["family"], r["provider"]): r for r in record.rows if r["kind"] == "run"}
    assert set(runs) == {(f, p) for f in ("gemma3", "qwen2_5_vl") for p in ("stock", "fk")}
    for family in ("gemma3", "qwen2_5_vl"):
        assert all(runs[family, p]["status"] == "ok" for p in ("stock", "fk"))
        fk = runs[family, "fk"]
        assert fk["patched"]["flce"] == 1 and not fk["logits_returned"] and fk["loss_rel_diff"] < 2e-2
    assert "fk.hf.vision_language.image_inputs" in record.notes


def test_merge_keeps_the_other_modes_rows() -> None:
    old = bench.BenchRecord("e2e", rows=[{"mode": "full", "v": 1}, {"mode": "lora", "v": 2}], notes="old")
    old.environment["date_utc"] = "then"
    new = bench.BenchRecord("e2e", rows=[{"mode": "lora", "v": 3}], notes="new")
    merged = testing.load_script(SCRIPT).merge_record(new, old, ["lora"])
    assert merged.rows == [{"measured_utc": "then", "mode": "full", "v": 1}, {"mode": "lora", "v": 3}]
    assert merged.notes == "new; llama full: from the call of then"


def test_merge_keeps_the_other_families_rows() -> None:
    """A run of other families keeps the Llama rows (those from before --family have no family)."""
    old = bench.BenchRecord("e2e", rows=[{"mode": "full", "v": 1}, {"family": "olmo3", "mode": "full", "v": 2}])
    new = bench.BenchRecord("e2e", rows=[{"family": "olmo3", "mode": "full", "v": 3}], notes="new")
    old.environment["date_utc"] = "before"
    merged = testing.load_script(SCRIPT).merge_record(new, old, ["full"], ("olmo3",))
    assert merged.rows == [
        {"measured_utc": "before", "mode": "full", "v": 1},
        {"family": "olmo3", "mode": "full", "v": 3},
    ]
    # merged again: the Llama row keeps the date of the call that measured it
    merged.environment["date_utc"] = "now"
    newer = bench.BenchRecord("e2e", rows=[{"family": "glm4", "mode": "full", "v": 4}], notes="newer")
    again = testing.load_script(SCRIPT).merge_record(newer, merged, ["full"], ("glm4",))
    assert again.rows[0]["measured_utc"] == "before" and again.rows[1]["measured_utc"] == "now"
    assert again.notes == "newer; llama full: from the call of before; olmo3 full: from the call of now"


def test_merge_keeps_the_other_shapes_rows() -> None:
    """A run at another shape (``--shape``, ``--layers``) keeps the default shape's rows of the same
    mode, and a later default-shape run keeps its rows."""
    e2e = testing.load_script(SCRIPT)
    old = bench.BenchRecord("e2e", rows=[{"mode": "qlora", "v": 1}], notes="old")
    old.environment["date_utc"] = "then"
    eight = {"mode": "qlora", "model": "llama-3.1-8b (8 layers)", "v": 2}
    new = bench.BenchRecord("e2e", rows=[eight], notes="new")
    merged = e2e.merge_record(new, old, ["qlora"], ("llama",), "llama-3.1-8b", 8)
    assert merged.rows == [{"measured_utc": "then", "mode": "qlora", "v": 1}, eight]
    assert merged.notes == "new; llama qlora: from the call of then"
    merged.environment["date_utc"] = "now"
    newer = bench.BenchRecord("e2e", rows=[{"mode": "qlora", "v": 3}], notes="newer")
    again = e2e.merge_record(newer, merged, ["qlora"])
    assert [r["v"] for r in again.rows] == [2, 3]
    assert again.notes == "newer; llama qlora at llama-3.1-8b (8 layers): from the call of now"
    table = e2e.table(
        bench.BenchRecord("e2e", rows=[{**r, "kind": "run", "provider": "stock", "status": "x"} for r in again.rows])
    )
    assert [line["model"] for line in table] == ["llama-3.1-8b (8 layers)", "llama-3.2-1b"]
