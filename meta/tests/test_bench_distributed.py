"""benchmarks/bench_distributed.py --tiny under ``torchrun --nproc-per-node 2`` on CPU (gloo, Triton's
interpreter): every code path of the GPU benchmark runs, and its record says what the GPU run
will check (fk's losses equal stock's and one process's; vocabulary-parallel equals one process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fk.core import bench, testing

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distributed.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")
@pytest.mark.serial
def test_tiny_run_under_torchrun(tmp_path: Path) -> None:
    # CPU tensors and gloo: the kernels run in Triton's interpreter, except on a GPU machine, where
    # the CPU tensors take the reference path (the GPU run of the benchmark covers the kernels).
    stdout = testing.run_python("-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), "--tiny",
                                "--steps", "1", "--out", str(tmp_path))  # fmt: skip
    record = bench.BenchRecord.from_json(tmp_path / "distributed-tiny.json")
    rows = {r["provider"]: r for r in record.rows}
    kinds = ("fsdp2", "fsdp2-head", "ddp")
    assert set(rows) == {f"{k} {p}" for k in kinds for p in ("stock", "fk")} | {
        "1 gpu fk",
        "fk 1 gpu",
        "fk vocab-parallel",
    }
    for kind in kinds:
        stock, fk = rows[f"{kind} stock"]["losses"], rows[f"{kind} fk"]["losses"]
        assert len(fk) == len(stock) == 1
        assert rows[f"{kind} fk"]["fused_loss"] and not rows[f"{kind} stock"]["fused_loss"]
        assert abs(fk[0] - stock[0]) < 1e-3 and abs(fk[0] - rows["1 gpu fk"]["losses"][0]) < 1e-3
    parallel = rows["fk vocab-parallel"]
    assert parallel["loss_err"] < 1e-2 and parallel["dh_err"] < 1e-2 * max(1.0, parallel["dh_scale"])
    assert parallel["dw_err"] < 1e-2 * max(1.0, parallel["dw_scale"])
    summary = stdout
    assert "| wrapper" in summary and "| fsdp2-head" in summary and "fk vocab-parallel" in summary
