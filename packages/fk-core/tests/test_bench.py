"""Tests of fk.core.bench: accounting, records, plots, tables, progress, the CUDA guards (on CPU), and timing (on a GPU)."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fk.core.bench as bench

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")


# --------------------------------------------------------------------------------------- accounting


def test_tbps_counts_decimal_terabytes_per_second() -> None:
    assert bench.tbps(1e12, 1000.0) == pytest.approx(1.0)
    assert bench.tbps(2 * 2**30, 0.5) == pytest.approx(2 * 2**30 / 0.5e-3 / 1e12)
    assert bench.tbps(3e9, 1.0) == pytest.approx(3.0)


def test_tflops_counts_decimal_teraflops_per_second() -> None:
    n = 8192
    assert bench.tflops(2 * n**3, 2.0) == pytest.approx(2 * n**3 / 2e-3 / 1e12)
    assert bench.tflops(5e11, 1.0) == pytest.approx(500.0)


def test_fraction() -> None:
    assert bench.fraction(2.4, 3.0) == pytest.approx(0.8)
    assert bench.fraction(0.0, 3.0) == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_accounting_rejects_non_positive_denominators(bad: float) -> None:
    with pytest.raises(ValueError):
        bench.tbps(1.0, bad)
    with pytest.raises(ValueError):
        bench.tflops(1.0, bad)
    with pytest.raises(ValueError):
        bench.fraction(1.0, bad)


def test_time_stats_from_samples() -> None:
    stats = bench.TimeStats.from_samples([5.0, 1.0, 3.0, 2.0, 4.0, 6.0])
    assert stats.n == 6
    assert stats.min == 1.0
    assert stats.median == pytest.approx(3.5)
    assert stats.p20 == pytest.approx(2.0)  # position 0.2 * 5 = 1.0 in [1, 2, 3, 4, 5, 6]
    assert stats.p80 == pytest.approx(5.0)
    single = bench.TimeStats.from_samples([0.25])
    assert (single.median, single.p20, single.p80, single.min, single.n) == (0.25, 0.25, 0.25, 0.25, 1)
    with pytest.raises(ValueError):
        bench.TimeStats.from_samples([])


# ------------------------------------------------------------------------------------- CUDA guards


@needs_no_cuda
def test_time_ms_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.time_ms(lambda: None)
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.time_stats_ms(lambda: None)
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.graph_time_us(lambda: None)


@needs_no_cuda
def test_peak_memory_needs_cuda() -> None:
    calls: list[int] = []
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.peak_memory_bytes(lambda: calls.append(1))
    assert calls == []


@needs_no_cuda
def test_ceilings_need_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.copy_bandwidth_tbps(1024)
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.matmul_tflops(64)
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.measure_ceilings()
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.measure_ceilings(gpu_only=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU")
def test_ceilings_timed_either_way_are_this_gpus() -> None:
    """Back to back and with the GPU idle before each call, both ceilings land in a range any
    current datacenter GPU reaches (a wrong count of bytes or FLOPs would miss it by 2x or more)."""
    for gpu_only in (False, True):
        ceilings = bench.measure_ceilings(gpu_only=gpu_only)
        assert 0.5 < ceilings.copy_tbps < 10 and 50 < ceilings.matmul_tflops < 3000, (gpu_only, ceilings)


def test_run_probe_with_check_runs_the_check_alone() -> None:
    calls: list[Any] = []
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=3)
    bench.run_probe(parser, calls.append, lambda args, copy: calls.append(("body", args.size)), ["--check"])
    assert calls == ["cuda" if torch.cuda.is_available() else "cpu"]
    if not torch.cuda.is_available():  # without --check: the check on "cuda", then the copy bandwidth, which needs it
        calls.clear()
        with pytest.raises(RuntimeError, match="CUDA"):
            bench.run_probe(argparse.ArgumentParser(), calls.append, lambda args, copy: calls.append("body"), [])
        assert calls == ["cuda"]


@pytest.mark.gpu
@pytest.mark.serial
def test_gpu_only_leaves_the_host_out() -> None:
    """A call whose host path (here a 1 ms Python wait) outlasts its GPU work: the plain timing
    measures the host, ``gpu_only`` the GPU work alone; a host path longer than half the head start
    raises instead of returning a number that would include it."""
    x = torch.randn(1 << 20, device="cuda")

    def slow_host() -> None:
        time.sleep(1e-3)
        x.mul_(1.0)

    plain = bench.time_ms(slow_host, warmup=2, rep=10)
    gpu = bench.time_ms(slow_host, warmup=2, rep=10, gpu_only=True)
    assert plain > 0.9 and gpu < 0.2, (plain, gpu)
    with pytest.raises(RuntimeError, match="head start"):  # every call's host path too long
        bench.time_ms(lambda: time.sleep(0.6e-3 * bench.HOST_HEAD_START_MS), warmup=0, rep=2, gpu_only=True)


@pytest.mark.gpu
@pytest.mark.serial
def test_graph_time_counts_the_gpu_work_of_one_call() -> None:
    """Calls of a 50 us spin kernel replayed from a CUDA graph: 50 us a call, whatever the host (a
    1 ms Python wait per call does not count: it runs at capture, not at replay)."""
    spin = bench._spin_cycles(0.05)

    def call() -> None:
        time.sleep(1e-3)
        torch.cuda._sleep(spin)

    us = bench.graph_time_us(call, calls=10, replays=3)
    assert 40 < us < 70, us
    with pytest.raises(ValueError, match="calls"):
        bench.graph_time_us(call, calls=0)


# ------------------------------------------------------------------------------------------ records


def test_environment_keys() -> None:
    env = bench.environment()
    assert {"gpu", "gpu_count", "torch", "triton", "python", "peers", "fk", "date_utc"} <= set(env)
    assert env["torch"] == torch.__version__
    assert set(env["peers"]) == {"liger-kernel", "cut-cross-entropy", "transformers", "peft", "trl", "bitsandbytes"}
    assert set(env["fk"]) == {"fk-core", "fk-norms", "fk-rope", "fk-glu", "fk-flce", "fk-lora", "fk-align", "fk-hf"}
    assert all(v is None or isinstance(v, str) for v in [*env["peers"].values(), *env["fk"].values()])
    assert env["date_utc"].endswith("+00:00")
    here = Path(bench.__file__).resolve().parents
    in_checkout = here[3].name == "fk-core" and (here[5] / "VERSION").exists()
    assert env["fk_source"] == ((here[5] / "VERSION").read_text().strip() if in_checkout else None)
    if not torch.cuda.is_available():
        assert env["gpu"] == "cpu"
        assert env["gpu_count"] == 0
    json.dumps(env)  # serializable as is


def test_environment_has_no_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    import platform
    import socket

    marker = "fk-test-host-7f3a9c"
    monkeypatch.setattr(socket, "gethostname", lambda: marker)
    monkeypatch.setattr(platform, "node", lambda: marker)
    assert marker not in json.dumps(bench.environment())


def _record() -> bench.BenchRecord:
    rec = bench.BenchRecord(name="rmsnorm", environment={"gpu": "cpu"}, ceilings={"copy_tbps": 3.0})
    for provider, speed in [("fk", 2.4), ("torch", 1.2)]:
        for mode in ["fwd", "fwd+bwd"]:
            for hidden in [1024, 4096, 16384]:
                rec.add(provider=provider, mode=mode, hidden=hidden, tbps=speed * hidden / 16384, ms=0.1)
    rec.add(provider="liger", mode="fwd", hidden=16384, tbps=None, error="OOM")
    rec.add(provider="eager", mode="fwd", hidden=16384)  # no y field at all
    return rec


def test_record_add_requires_provider() -> None:
    rec = bench.BenchRecord(name="x", environment={})
    row = rec.add(provider="fk", ms=1.5)
    assert rec.rows == [{"provider": "fk", "ms": 1.5}]
    assert row is rec.rows[0]
    with pytest.raises(ValueError, match="provider"):
        rec.add(ms=2.0)


def test_record_default_environment() -> None:
    rec = bench.BenchRecord(name="x")
    assert rec.environment["torch"] == torch.__version__
    assert rec.rows == [] and rec.ceilings == {} and rec.notes == ""


def test_record_json_round_trip(tmp_path: Path) -> None:
    rec = _record()
    rec.notes = "bytes: read x and w, write y"
    rec.add(provider="fk", dtype=torch.bfloat16, shape=torch.Size([2, 3]))
    path = rec.to_json(tmp_path / "deep" / "dir" / "rmsnorm.json")
    assert path.is_file()
    text = path.read_text()
    assert text.startswith("{\n  ")  # indented
    back = bench.BenchRecord.from_json(path)
    assert back.name == "rmsnorm"
    assert back.environment == {"gpu": "cpu"}
    assert back.ceilings == {"copy_tbps": 3.0}
    assert back.notes == rec.notes
    assert back.rows[:-1] == rec.rows[:-1]
    assert back.rows[-1] == {"provider": "fk", "dtype": "torch.bfloat16", "shape": [2, 3]}
    assert len(back.rows) == 15


def test_ceilings_as_dict() -> None:
    assert bench.Ceilings(copy_tbps=3.1, matmul_tflops=700.0).as_dict() == {"copy_tbps": 3.1, "matmul_tflops": 700.0}


# -------------------------------------------------------------------------------------------- plots


def _is_png(path: Path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_with_facets_and_hline(tmp_path: Path) -> None:
    out = bench.plot(
        _record(),
        x="hidden",
        y="tbps",
        facet="mode",
        path=tmp_path / "plots" / "rmsnorm.png",
        title="RMSNorm",
        logx=True,
        ylabel="TB/s",
        hline=3.0,
        hline_label="copy",
    )
    assert out == tmp_path / "plots" / "rmsnorm.png"
    assert _is_png(out)


def test_plot_facets_make_a_wider_figure(tmp_path: Path) -> None:
    from matplotlib.image import imread

    one = bench.plot(_record(), x="hidden", y="tbps", path=tmp_path / "one.png")
    two = bench.plot(_record(), x="hidden", y="tbps", facet="mode", path=tmp_path / "two.png")
    assert _is_png(one) and _is_png(two)
    h1, w1 = imread(one).shape[:2]
    h2, w2 = imread(two).shape[:2]
    assert h1 == h2
    assert w2 == 2 * w1


def test_plot_closes_its_figure(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    before = len(plt.get_fignums())
    bench.plot(_record(), x="hidden", y="ms", path=tmp_path / "ms.png")
    assert len(plt.get_fignums()) == before


def test_plot_without_any_y_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="peak_mb"):
        bench.plot(_record(), x="hidden", y="peak_mb", path=tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


# ------------------------------------------------------------------------------------ markdown table


def _cells(line: str) -> list[str]:
    """The stripped cells of a Markdown table line, splitting on unescaped pipes."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_markdown_table() -> None:
    rows = [
        {"provider": "fk", "ms": 0.123456, "tbps": 2.71828, "peak_mb": 12345.6, "n": 4096},
        {"provider": "liger", "ms": 12.0, "tbps": 0.0001234, "n": 8192},
        {"provider": "a|b", "ms": 99.96, "tbps": 0.0},
    ]
    lines = bench.markdown_table(rows, ["provider", "ms", "tbps", "peak_mb", "n"]).splitlines()
    assert len(lines) == 5
    assert _cells(lines[0]) == ["provider", "ms", "tbps", "peak_mb", "n"]
    assert _cells(lines[1]) == ["--------", "----:", "-------:", "------:", "---:"]  # numbers right-aligned
    assert _cells(lines[2]) == ["fk", "0.123", "2.72", "12346", "4096"]
    assert _cells(lines[3]) == ["liger", "12.0", "1.23e-04", "", "8192"]
    assert _cells(lines[4]) == ["a\\|b", "100", "0", "", ""]
    assert len({len(line) for line in lines}) == 1  # padded to equal width


def test_markdown_table_skips_absent_columns() -> None:
    rows = [{"a": 1, "b": None}, {"a": 2}]
    assert bench.markdown_table(rows, ["a", "b", "c"], skip_absent=True) == bench.markdown_table(rows, ["a", "b"])
    assert "| c" in bench.markdown_table(rows, ["a", "b", "c"])  # kept (blank) without the flag


def test_markdown_table_empty() -> None:
    assert bench.markdown_table([], ["a", "bb"]).splitlines() == ["| a   | bb  |", "| --- | --- |"]


def test_markdown_table_float_formatting() -> None:
    cases = {1.0: "1.00", 1234.5: "1234", 0.5: "0.500", 0.001234: "0.00123", -2.5: "-2.50", math.inf: "inf"}
    table = bench.markdown_table([{"v": v} for v in cases], ["v"])
    assert [line.strip("| ").strip() for line in table.splitlines()[2:]] == list(cases.values())


# ----------------------------------------------------------------------------------------- progress


def test_progress_yields_all_items_quietly_without_tty(capsys: pytest.CaptureFixture[str]) -> None:
    items = list(bench.progress(range(7), desc="sweep"))
    assert items == list(range(7))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("[sweep] 7/7 ")
    assert "\r" not in err


def test_progress_generator_without_len(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(bench.progress(iter("abc"))) == ["a", "b", "c"]
    assert capsys.readouterr().err.startswith("3 ")
    assert list(bench.progress(iter("abc"), total=3, desc="x")) == ["a", "b", "c"]
    assert capsys.readouterr().err.startswith("[x] 3/3 ")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Tty()
    monkeypatch.setattr("sys.stderr", fake)
    assert list(bench.progress([10, 20, 30], desc="d")) == [10, 20, 30]
    out = fake.getvalue()
    assert out.count("\r") == 4  # initial 0/3, then after each item
    assert "\r[d] 0/3 " in out and "\r[d] 3/3 " in out
    assert out.endswith("\n") and out.count("\n") == 1


def test_progress_ends_line_when_loop_breaks(capsys: pytest.CaptureFixture[str]) -> None:
    gen = bench.progress(range(10), desc="b")
    for i in gen:
        if i == 2:
            break
    gen.close()
    err = capsys.readouterr().err
    assert err.startswith("[b] 2/10 ") and err.endswith("\n")


def test_fresh_compile_never_falls_back_to_eager(device: str) -> None:
    """One compilation per case: a plain torch.compile of the same function, once dynamo's recompile
    limit is reached, runs it eagerly without a word (no graph), which is what fresh_compile avoids."""
    from torch._dynamo.utils import counters

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def graphs(fn: Any, n: int) -> int:
        counters.clear()
        # (on the GPU where there is one: Triton kernels compile in a second where the CPU's C++
        # took minutes with 14 test workers sharing the host)
        torch.testing.assert_close(fn(torch.ones(n, device=device)), torch.full((n,), 3.0, device=device))
        return int(counters["stats"]["unique_graphs"])

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        plain = [graphs(torch.compile(f, dynamic=False), n) for n in (3, 4)]
        fresh = [graphs(bench.fresh_compile(f), n) for n in (3, 4, 5)]
    torch._dynamo.reset()
    assert plain == [1, 0]  # the second shape ran eagerly: the failure mode itself
    assert fresh == [1, 1, 1]


def test_merge_records_keeps_the_cases_not_run_with_their_dates() -> None:
    old = bench.BenchRecord("x", rows=[{"op": "a", "provider": "fk", "ms": 1.0},
                                       {"op": "b", "provider": "fk", "ms": 2.0, "measured_utc": "earlier"}])  # fmt: skip
    old.environment["date_utc"] = "then"
    new = bench.BenchRecord("x", rows=[{"op": "a", "provider": "fk", "ms": 3.0}], notes="now")
    merged = bench.merge_records(new, old, lambda row: row["op"], ["a"])
    assert merged.rows == [{"op": "b", "provider": "fk", "ms": 2.0, "measured_utc": "earlier"},
                           {"op": "a", "provider": "fk", "ms": 3.0}]  # fmt: skip
    assert merged.notes == "now; b: from the call of earlier"


def test_floor_ms_adds_the_bytes_at_copy_bandwidth_and_the_flops_at_the_matmul_ceiling() -> None:
    ceilings = bench.Ceilings(copy_tbps=2.0, matmul_tflops=500.0)
    assert bench.floor_ms(ceilings, nbytes=2e9) == pytest.approx(1.0)  # 2 GB at 2 TB/s
    assert bench.floor_ms(ceilings, flops=5e11) == pytest.approx(1.0)  # 0.5 PFLOP at 500 TFLOP/s
    assert bench.floor_ms(ceilings, nbytes=2e9, flops=5e11) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive ceilings"):
        bench.floor_ms(bench.Ceilings(copy_tbps=0.0, matmul_tflops=1.0), nbytes=1.0)


def test_cpu_time_ms_is_the_median_of_the_timed_calls_and_clears_gradients() -> None:
    leaf = torch.ones(2, requires_grad=True)
    calls: list[bool] = []

    def step() -> None:
        calls.append(leaf.grad is None)
        (leaf * 2).sum().backward()

    ms = bench.cpu_time_ms(step, warmup=1, rep=3, grad_to_none=[leaf])
    assert ms >= 0 and calls == [True] * 4
    with pytest.raises(ValueError, match="rep >= 1"):
        bench.cpu_time_ms(step, rep=0)


# ------------------------------------------------------------------------ runs in fresh processes


def test_odd_rounds_run_the_providers_in_reverse() -> None:
    order = bench.round_order(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]


def test_rounds_merge_into_the_median_of_all_steps() -> None:
    rounds = [
        {"step_seconds": [1.0, 2.0, 9.0], "tokens_per_step": 100, "peak_gib": 3.0, "losses": [5.0]},
        {"step_seconds": [3.0, 4.0, 4.0], "tokens_per_step": 100, "peak_gib": 4.0, "losses": [6.0]},
    ]
    merged = bench.merge_rounds(rounds)
    assert merged["median_step_ms"] == pytest.approx(3500.0)  # the median of the six steps
    assert merged["tokens_per_s"] == pytest.approx(100 / 3.5)
    assert merged["round_tokens_per_s"] == pytest.approx([50.0, 25.0])  # each round's own median
    assert merged["round_step_ms"] == [[1000.0, 2000.0, 9000.0], [3000.0, 4000.0, 4000.0]]
    assert merged["peak_gib"] == 4.0 and merged["losses"] == [5.0]  # the largest peak; the first round's losses
    assert "round_host_ms" not in merged  # (not measured)


def test_rounds_keep_host_and_collector_times_where_measured() -> None:
    rounds = [
        {"step_seconds": [1.0], "host_seconds": [0.25], "gc_seconds": [0.0], "tokens_per_step": 1, "peak_gib": None},
        {"step_seconds": [2.0], "host_seconds": [1.5], "gc_seconds": [0.125], "tokens_per_step": 1, "peak_gib": None},
    ]
    merged = bench.merge_rounds(rounds)
    assert merged["round_host_ms"] == [[250.0], [1500.0]] and merged["round_gc_ms"] == [[0.0], [125.0]]
    assert merged["peak_gib"] is None


def test_max_relative_diff_needs_a_reference_of_the_same_length() -> None:
    assert bench.max_relative_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert bench.max_relative_diff([1.0], [1.0, 2.0]) is None and bench.max_relative_diff([1.0], None) is None


WORKER_SCRIPT = """
import sys
sys.path.insert(0, SRC)  # where the test's fk.core comes from
from fk.core import bench

def worker(job):
    if job["kind"] == "import":
        import a_module_that_is_not_installed  # noqa: F401
    if job["kind"] == "crash":
        raise RuntimeError("the worker broke")
    return {"twice": 2 * job["x"]}

bench.worker_main(worker, sys.argv[2], sys.argv[4])
"""


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("ok", {"twice": 6}), ("import", "skipped: ModuleNotFoundError"), ("crash", "failed: exit status 1")],
)
def test_run_worker_returns_the_workers_json_or_why_there_is_none(tmp_path: Path, kind: str, expected: Any) -> None:
    """A worker's result comes back as JSON; a missing import is a skip, an exception a failure
    whose message ends with the worker's own error."""
    script = tmp_path / "script.py"
    script.write_text(WORKER_SCRIPT.replace("SRC", repr(str(Path(bench.__file__).parents[2]))))
    out = bench.run_worker(script, {"kind": kind, "x": 3}, timeout_s=120)
    if isinstance(expected, dict):
        assert out == expected
        return
    assert bench.worker_status(out).startswith(expected)
    if kind == "crash":
        assert out["failed"].endswith("RuntimeError: the worker broke")
        assert bench.status_line(bench.worker_status(out)) == "failed: RuntimeError: the worker broke"


def test_status_line_keeps_a_tracebacks_exception() -> None:
    """A table cell shows a failure's exception (the traceback's last line), a skip's first line."""
    trace = 'failed: exit status 1:   File "x.py", line 3, in f\n    g()\nTypeError: bad keyword'
    assert bench.status_line(trace) == "failed: TypeError: bad keyword"
    assert bench.status_line("skipped: ImportError: no liger\nmore") == "skipped: ImportError: no liger"
    assert bench.status_line("failed: timed out after 420 s") == "failed: timed out after 420 s"
    assert bench.status_line("skipped: " + "x" * 100, width=20) == "skipped: " + "x" * 11
    assert bench.status_line("") == ""
