"""benchmarks/bench_e2e.py: the order of its timed rounds, how it merges them, and a --tiny run on
the CPU (Triton's interpreter) with two rounds, whose record must hold each round's speed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fk.core import bench, testing

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_e2e.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")


def _script() -> ModuleType:
    module: ModuleType = testing.import_script(SCRIPT)
    return module


def test_odd_rounds_run_the_providers_in_reverse() -> None:
    order = _script().round_order(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]


def test_rounds_merge_into_the_median_of_all_steps() -> None:
    rounds = [
        {"step_seconds": [1.0, 2.0, 9.0], "tokens_per_step": 100, "peak_gib": 3.0, "losses": [5.0]},
        {"step_seconds": [3.0, 4.0, 4.0], "tokens_per_step": 100, "peak_gib": 4.0, "losses": [6.0]},
    ]
    merged = _script().merge_rounds(rounds)
    assert merged["median_step_ms"] == pytest.approx(3500.0)  # the median of the six steps
    assert merged["tokens_per_s"] == pytest.approx(100 / 3.5)
    assert merged["round_tokens_per_s"] == pytest.approx([50.0, 25.0])  # each round's own median
    assert merged["peak_gib"] == 4.0 and merged["losses"] == [5.0]  # the largest peak; the first round's losses


@pytest.mark.serial
def test_tiny_run_with_two_rounds(tmp_path: Path) -> None:
    interpret = "0" if torch.cuda.is_available() else "1"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(SCRIPT), "--tiny", "--modes", "full", "--providers", "stock", "fk",
               "--rounds", "2", "--search-seconds", "0", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-5000:]}"
    record = bench.BenchRecord.from_json(tmp_path / "e2e.json")
    runs = {r["provider"]: r for r in record.rows if r["kind"] == "run"}
    assert set(runs) == {"stock", "fk"}
    for run in runs.values():
        assert run["status"] == "ok" and len(run["round_tokens_per_s"]) == 2
        assert min(run["round_tokens_per_s"]) <= run["tokens_per_s"] <= max(run["round_tokens_per_s"])
    assert runs["fk"]["loss_rel_diff"] < 2e-2
    assert "2 rounds of 2 timed steps" in record.notes


def test_merge_keeps_the_other_modes_rows() -> None:
    old = bench.BenchRecord("e2e", rows=[{"mode": "full", "v": 1}, {"mode": "lora", "v": 2}], notes="old")
    old.environment["date_utc"] = "then"
    new = bench.BenchRecord("e2e", rows=[{"mode": "lora", "v": 3}], notes="new")
    merged = _script().merge_record(new, old, ["lora"])
    assert merged.rows == [{"measured_utc": "then", "mode": "full", "v": 1}, {"mode": "lora", "v": 3}]
    assert merged.notes == "new; llama full: from the call of then"


def test_merge_keeps_the_other_families_rows() -> None:
    """A run of other families keeps the Llama rows (those from before --family have no family)."""
    old = bench.BenchRecord("e2e", rows=[{"mode": "full", "v": 1}, {"family": "olmo3", "mode": "full", "v": 2}])
    new = bench.BenchRecord("e2e", rows=[{"family": "olmo3", "mode": "full", "v": 3}], notes="new")
    old.environment["date_utc"] = "before"
    merged = _script().merge_record(new, old, ["full"], ("olmo3",))
    assert merged.rows == [
        {"measured_utc": "before", "mode": "full", "v": 1},
        {"family": "olmo3", "mode": "full", "v": 3},
    ]
    # merged again: the Llama row keeps the date of the call that measured it
    merged.environment["date_utc"] = "now"
    newer = bench.BenchRecord("e2e", rows=[{"family": "glm4", "mode": "full", "v": 4}], notes="newer")
    again = _script().merge_record(newer, merged, ["full"], ("glm4",))
    assert again.rows[0]["measured_utc"] == "before" and again.rows[1]["measured_utc"] == "now"
    assert again.notes == "newer; llama full: from the call of before; olmo3 full: from the call of now"
