"""benchmarks/bench_lora.py: a --qlora --tiny run end to end (fk against PEFT + bitsandbytes, on the
CPU in Triton's interpreter and bitsandbytes' CPU backend, or on the GPU), whose record holds every
block with both providers; its table, its floor's bytes, and report.py reading a QLoRA record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fk.core import bench, testing

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "bench_lora.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs a checkout with benchmarks/")
MEASURED = {"ms", "gpu_ms", "floor_ms", "floor_fraction", "peak_mb", "provider"}
"""The fields of a timed row that differ between the providers of one case (report.py groups the
rows of a case by all the others)."""


def _load(path: Path) -> ModuleType:
    module: ModuleType = testing.load_script(path)
    return module


@pytest.mark.serial
def test_tiny_qlora_run_times_fk_and_peft_for_every_block(tmp_path: Path) -> None:
    testing.require_bitsandbytes_4bit("cuda" if torch.cuda.is_available() else "cpu")
    interpret = "0" if torch.cuda.is_available() else "1"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(SCRIPT), "--qlora", "--tiny", "--adapters", "fp32", "--dropout", "0", "0.05",
               "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-5000:]}"
    record = bench.BenchRecord.from_json(tmp_path / "lora_qlora.json")
    blocks = _load(SCRIPT).BLOCKS
    cases = {(r["block"], r["dropout"], r["provider"]) for r in record.rows}
    assert cases == {(b, d, p) for b in blocks for d in (0.0, 0.05) for p in ("peft", "fk")}
    assert all(r["qlora"] == "nf4" and r["ms"] > 0 and r["tokens"] == 64 for r in record.rows)
    if torch.cuda.is_available():  # the floor needs the ceilings, measured on a GPU only
        assert all(r["floor_fraction"] > 0 for r in record.rows)
    keys = {tuple(sorted((k, str(v)) for k, v in r.items() if k not in MEASURED)) for r in record.rows}
    assert len(keys) == len(blocks) * 2, "the providers' rows of a case must differ only in their measurements"
    assert "| nf4" in out.stdout and "TINY CHECK" in record.notes


def test_dequantization_bytes_count_codes_scales_and_the_bf16_weight() -> None:
    module = _load(SCRIPT)
    # o at the tiny shape: one [64, 64] weight, 4096 codes in 64 blocks of 64, one nested block
    assert module.dequantization_bytes("o", module.TINY) == 4096 // 2 + 64 + 4 * 1 + 2 * 4096
    n, k = module.LLAMA.inter, module.LLAMA.hidden
    blocks = n * k // 64
    per_weight = n * k // 2 + blocks + 4 * (blocks // 256) + 2 * n * k
    assert module.dequantization_bytes("mlp") == 3 * per_weight


def _row(provider: str, ms: float, **extra: object) -> dict[str, object]:
    return {"provider": provider, "block": "mlp", "tokens": 4096, "dropout": 0.0, "adapter": "fp32",
            "mode": "fwd+bwd", "ms": ms, **extra}  # fmt: skip


def test_tables_and_report_read_a_qlora_record() -> None:
    record = bench.BenchRecord("lora", environment={"gpu": "test"}, rows=[
        _row("peft", 12.0, qlora="nf4", gpu_ms=10.0, peak_mb=300.0, floor_ms=4.0, floor_fraction=4.0 / 12.0,
             gemm_ms=3.5),
        _row("fk", 8.0, qlora="nf4", gpu_ms=5.0, peak_mb=100.0, floor_ms=4.0, floor_fraction=0.5, gemm_ms=3.5),
        _row("peft", 6.0, gpu_ms=6.0, peak_mb=90.0, tflops=1.0, matmul_fraction=0.5),
        _row("fk", 4.0, gpu_ms=4.0, peak_mb=45.0, tflops=1.5, matmul_fraction=0.9),
    ])  # fmt: skip
    dense, qlora = _load(SCRIPT).speedups(record)
    assert "qlora" not in dense and dense["fk matmul%"] == pytest.approx(90.0) and "fk floor%" not in dense
    assert qlora["qlora"] == "nf4" and qlora["x peft"] == pytest.approx(1.5)
    assert qlora["fk floor%"] == pytest.approx(50.0) and qlora["memory / peft"] == pytest.approx(1 / 3)
    report = _load(BENCHMARKS / "report.py")
    assert report.bench_script("lora_qlora").name == "bench_lora.py"
    assert report.bench_script("lora_dora").name == "bench_lora.py"
    assert report.bench_script("norms").name == "bench_norms.py"
    fk_qlora = record.rows[1]
    assert report.floor_share(fk_qlora) == pytest.approx(0.5 * 8.0 / 5.0)  # from the GPU-only time
    lines = report.shortfalls(record)
    assert len(lines) == 1 and "qlora=nf4" in lines[0] and "% of the floor" in lines[0]
    assert "gemm_ms" not in lines[0]  # a measurement, not part of the case's name


def test_dropout_bytes_count_each_mask_written_and_read() -> None:
    """Each adapter's byte mask over its input, written once and read once: 2 bytes an element of
    each adapter's input (for bf16 and fp32 adapters alike: the adapter's dtype is not an argument)."""
    module = _load(SCRIPT)
    tokens, hidden, inter = 4096, module.LLAMA.hidden, module.LLAMA.inter
    assert module.dropout_bytes("o", tokens) == 2 * tokens * hidden
    assert module.dropout_bytes("qkv", tokens) == 3 * 2 * tokens * hidden
    assert module.dropout_bytes("mlp", tokens) == 2 * tokens * (2 * hidden + inter)


def test_refloor_recomputes_floors_from_the_run_and_keeps_the_measurements() -> None:
    module = _load(SCRIPT)
    ceilings = {"copy_tbps": 4.0, "matmul_tflops": 600.0}
    rows = [_row("fk", 8.0, dropout=0.05, gpu_ms=6.0, tflops=1.0, matmul_fraction=0.5),
            _row("fk", 5.0, gpu_ms=4.0, tflops=1.0, matmul_fraction=0.5)]  # fmt: skip
    record = module.refloor(bench.BenchRecord("lora", rows=[dict(r) for r in rows], ceilings=ceilings, notes="n"))
    flops = module._flops("mlp", 4096)
    with_dropout, without = record.rows
    assert with_dropout["floor_ms"] == pytest.approx(
        bench.floor_ms(bench.Ceilings(**ceilings), nbytes=module.dropout_bytes("mlp", 4096), flops=flops)
    )
    assert without["floor_ms"] == pytest.approx(flops / 600e12 * 1e3)
    assert with_dropout["floor_fraction"] == pytest.approx(with_dropout["floor_ms"] / 8.0)
    assert with_dropout["ms"] == 8.0 and with_dropout["gpu_ms"] == 6.0  # measurements untouched
    assert module.DROPOUT_FLOOR in record.notes
    assert module.refloor(record).notes.count(module.DROPOUT_FLOOR) == 1  # once, however often it runs
    older = bench.BenchRecord("lora", rows=[dict(r) for r in rows], ceilings=ceilings,
                              notes=f"n; {module.PEFT_MASKS_FLOOR}")  # fmt: skip
    notes = module.refloor(older).notes  # the old accounting replaced, not kept beside the new
    assert module.PEFT_MASKS_FLOOR not in notes and notes.count(module.DROPOUT_FLOOR) == 1


def test_the_floor_takes_cublas_time_for_the_base_products_where_faster() -> None:
    """A row's ``gemm_ms`` (cuBLAS's time for its base products) replaces their FLOPs at the ceiling
    only where it is shorter, twice for DoRA with dropout (its products run twice), and there, where
    both sets were timed in one call (``gemm_twice_ms``), that time, with the ceiling's time scaled by
    its ratio to twice ``gemm_ms``; the bytes stay."""
    module = _load(SCRIPT)
    ceilings = bench.Ceilings(copy_tbps=4.0, matmul_tflops=600.0)
    at_ceiling = bench.floor_ms(ceilings, flops=module._flops("mlp", 4096))
    masks = bench.floor_ms(ceilings, nbytes=module.dropout_bytes("mlp", 4096))

    def floor(gemm_ms: float | None, dora: bool = False, twice: float | None = None) -> float:
        return module._against_ceilings(ceilings, "mlp", 4096, module.LLAMA, False, 1.0, dora, 0.05, gemm_ms, twice)[
            "floor_ms"
        ]

    assert floor(None) == pytest.approx(at_ceiling + masks)
    assert floor(0.8 * at_ceiling) == pytest.approx(0.8 * at_ceiling + masks)
    assert floor(1.2 * at_ceiling) == pytest.approx(at_ceiling + masks)  # never above the ceiling's
    weights = bench.floor_ms(ceilings, nbytes=module.dora_floor_work("mlp", 4096, 0.05)[1])
    assert floor(0.8 * at_ceiling, dora=True) == pytest.approx(2 * 0.8 * at_ceiling + weights + masks)
    # both sets timed in one call, 10% slower than twice one: that time, and the ceiling's scaled alike
    assert floor(0.8 * at_ceiling, dora=True, twice=1.1 * 2 * 0.8 * at_ceiling) == pytest.approx(
        1.1 * 2 * 0.8 * at_ceiling + weights + masks
    )
    assert floor(1.2 * at_ceiling, dora=True, twice=1.1 * 2 * 1.2 * at_ceiling) == pytest.approx(
        1.1 * 2 * at_ceiling + weights + masks
    )
    assert floor(0.8 * at_ceiling, twice=2.0 * at_ceiling) == pytest.approx(0.8 * at_ceiling + masks)  # (not DoRA)


def test_base_products_are_each_projections_forward_and_input_gradient() -> None:
    module = _load(SCRIPT)
    hidden, inter = module.LLAMA.hidden, module.LLAMA.inter
    q, kv = module.LLAMA.heads * module.LLAMA.head_dim, module.LLAMA.kv_heads * module.LLAMA.head_dim
    assert module.base_products("o", 8, fused=True) == [(8, q, hidden, "nt"), (8, hidden, q, "nn")]
    assert module.base_products("qkv", 8, fused=True) == [(8, hidden, q + 2 * kv, "nt"), (8, q + 2 * kv, hidden, "nn")]
    separate = module.base_products("mlp", 8, fused=False)
    fused = module.base_products("mlp", 8, fused=True)
    assert separate == [(8, hidden, inter, "nt")] * 2 + [(8, inter, hidden, "nt")] + [(8, inter, hidden, "nn")] * 2 + [
        (8, hidden, inter, "nn")
    ]
    assert fused == [(8, hidden, 2 * inter, "nt"), (8, inter, hidden, "nt"), (8, 2 * inter, hidden, "nn"),
                     (8, hidden, inter, "nn")]  # fmt: skip
    for products in (separate, fused):  # the FLOPs the floor counts, whichever way they are grouped
        assert sum(2 * m * k * n for m, k, n, _ in products) == module._flops("mlp", 8)
