"""benchmarks/bench_memory.py: the order in which its search tries sequence lengths, and a --tiny
run under DeepSpeed (its CPU accelerator on a CPU machine) whose simulated out-of-memory lengths
the search must find the edge of, with fk's fused loss running where stock computes logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fk.core import bench, testing

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")


def test_search_doubles_until_a_failure_then_bisects_to_the_granule() -> None:
    next_seq = testing.load_script(SCRIPT).next_seq
    fits = 5000  # lengths up to this train
    lo = hi = None
    tried = []
    while (seq := next_seq(lo, hi, 1024, 256)) is not None:
        tried.append(seq)
        lo, hi = (seq, hi) if seq <= fits else (lo, seq)
    assert tried == [1024, 2048, 4096, 8192, 6144, 5120, 4608, 4864]
    assert (lo, hi) == (4864, 5120)
    assert next_seq(None, 1024, 1024, 256) is None  # the first length failed: nothing shorter is tried
    assert next_seq(4096, None, 1024, 256, cap=6000) == 6000  # doubling stops at the cap
    assert next_seq(6000, None, 1024, 256, cap=6000) is None


@pytest.mark.serial
def test_tiny_run_finds_the_longest_length_that_trains(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(SCRIPT), "--tiny", "--providers", "stock", "fk", "--simulate-oom-above", "40",
               "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-5000:]}"
    record = bench.BenchRecord.from_json(tmp_path / "memory-tiny.json")
    for provider in ("stock", "fk"):
        (run,) = record.subset(kind="offload", provider=provider).rows
        assert run["status"] == "ok" and (run["longest_seq"], run["bounded_by"]) == (40, 48)
        # The row keeps its own search settings (a merged record holds rows of several calls).
        assert (run["start"], run["max_seq"], run["granule"]) == (16, 256, 8)
        trials = record.subset(kind="trial", provider=provider).rows
        assert [(t["seq"], t["status"]) for t in trials] == [
            (16, "ok"), (32, "ok"), (64, "oom"), (48, "oom"), (40, "ok"),
        ]  # fmt: skip
        assert all(t["logits_returned"] == (provider == "stock") for t in trials if t["status"] == "ok")
    assert "| offload" in out.stdout
