"""benchmarks/bench_align.py: a --tiny run end to end (fk and eager, on the CPU in Triton's
interpreter), whose record holds every loss with the expected providers, fk agreeing with eager;
and its tables and merge on a record made by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from fk.core import bench, testing

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_align.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")
MEASURED = {"ms", "gpu_ms", "tflops", "matmul_fraction", "peak_mb", "rep", "provider"}
"""The fields of a timed row that differ between the providers of one case (report.py groups the
rows of a case by all the others)."""


@pytest.mark.serial
def test_tiny_run_measures_fk_and_eager_for_every_loss(tmp_path: Path) -> None:
    stdout = testing.run_python(str(SCRIPT), "--tiny", "--out", str(tmp_path))
    record = bench.BenchRecord.from_json(tmp_path / "align.json")
    losses = list(testing.load_script(SCRIPT).LOSSES)
    timed = [r for r in record.rows if r.get("table") == "time" and "ms" in r]
    assert {(r["loss"], r["provider"]) for r in timed} == {(loss, p) for loss in losses for p in ("fk", "eager")}
    skipped = {(r["loss"], r["provider"]) for r in record.rows if "status" in r}
    assert skipped == {(loss, p) for loss in losses for p in ("liger", "torch.compile")} | {("jsd", "trl")}
    for loss in losses:
        rows = [r for r in timed if r["loss"] == loss]
        assert all(r["ms"] > 0 for r in rows)
        cases = {tuple(sorted((k, str(v)) for k, v in r.items() if k not in MEASURED)) for r in rows}
        assert len(cases) == 1, f"{loss}: the providers' rows must differ only in their measurements: {cases}"
    checks = {(r["loss"], r["provider"]): r for r in record.rows if r.get("table") == "check"}
    for loss in losses:
        fk = checks[(loss, "fk")]
        assert fk["reference"] == "eager" and fk["enforced"]
        assert fk["loss_err"] < 2e-2 and fk["grad_err"] < 5e-2, fk
    assert "| dpo" in stdout and "Not measured" in stdout


def _row(loss: str, provider: str, ms: float, **extra: object) -> dict[str, object]:
    return {"table": "time", "loss": loss, "model": "m", "hidden": 8, "vocab": 16, "tokens": 64, "seq": 32,
            "provider": provider, "ms": ms, **extra}  # fmt: skip


def test_tables_compare_like_with_like_and_memory_with_liger() -> None:
    record = bench.BenchRecord("align", environment={"gpu": "test"}, rows=[
        _row("dpo", "fk", 10.0, gpu_ms=8.0, matmul_fraction=0.5, peak_mb=100.0),
        _row("dpo", "liger", 15.0, peak_mb=400.0),  # no GPU-only time: wall against wall
        _row("dpo", "eager", 30.0, gpu_ms=12.0, peak_mb=900.0),  # GPU-only against GPU-only
        {"table": "time", "loss": "dpo", "model": "m", "tokens": 64, "provider": "torch.compile",
         "status": "skipped: compiled at the largest token count only"},
    ])  # fmt: skip
    module = testing.load_script(SCRIPT)
    (line,) = module.time_table(record)
    assert line["x liger"] == pytest.approx(1.5) and line["x eager"] == pytest.approx(1.5)
    assert line["speedup"] == pytest.approx(1.5) and line["fk matmul%"] == pytest.approx(50.0)
    (memory,) = module.memory_table(record)
    assert memory["fk / liger"] == pytest.approx(0.25)
    text = module.summary(record)
    assert "| dpo" in text and "skipped" not in text


def test_merge_keeps_the_other_losses_rows() -> None:
    module = testing.load_script(SCRIPT)
    old = bench.BenchRecord("align", rows=[_row("dpo", "fk", 1.0), _row("jsd", "fk", 2.0)])
    old.environment["date_utc"] = "then"
    new = bench.BenchRecord("align", rows=[_row("jsd", "fk", 3.0)], notes="new")
    merged = module.merge_record(new, old, ["jsd"])
    assert [(r["loss"], r["ms"], r.get("measured_utc")) for r in merged.rows] == [("dpo", 1.0, "then"),
                                                                                 ("jsd", 3.0, None)]  # fmt: skip
    assert merged.notes == "new; dpo: from the call of then"
