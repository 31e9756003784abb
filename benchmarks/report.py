"""Rebuild the tables of docs/benchmarks.md from the committed JSON records (no GPU needed).

    python benchmarks/report.py

For each ``benchmarks/results/<name>.json`` it imports ``benchmarks/bench_<name>.py`` (or, for a
record a script writes beside its main one, such as ``lora_qlora.json``, the script of the longest
``_``-separated prefix of the name that has one: ``bench_lora.py``) and calls its ``summary(record)``; the tables land between the ``<!-- results:<name> -->`` and
``<!-- /results:<name> -->`` markers of docs/benchmarks.md, with the GPU, versions and date of the
run, so the page never quotes a number that is not in a committed record.

It also lists, per record, every case where fk is behind the fastest peer and every case under
85% of its floor (:func:`shortfalls`), printed and written between the ``<!-- shortfalls -->``
markers of the same page.
"""

from __future__ import annotations

import importlib.util
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from fk.core import bench

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"


def bench_script(name: str) -> Path:
    """The script that wrote record ``name``: ``bench_<name>.py``, else that of the longest prefix of
    ``name`` cut at a ``_`` (``lora_qlora``: ``bench_lora.py``, run with ``--qlora``)."""
    parts = name.split("_")
    for end in range(len(parts), 0, -1):
        path = ROOT / "benchmarks" / f"bench_{'_'.join(parts[:end])}.py"
        if path.exists():
            return path
    raise FileNotFoundError(f"no benchmarks/bench_*.py script for the record {name}.json")


def _section(name: str, record: bench.BenchRecord) -> str:
    script = bench_script(name)
    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = record.environment
    peers = ", ".join(f"{k} {v}" for k, v in sorted((env.get("peers") or {}).items()) if v)
    ceilings = record.ceilings
    measured = (  # (a record of whole training runs, such as memory.json, measures none)
        f" Ceilings in the same run: copy {ceilings['copy_tbps']:.2f} TB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s."
        if ceilings
        else ""
    )
    head = (
        f"Measured on {env.get('gpu')} on {env.get('date_utc')}, torch {env.get('torch')}, triton {env.get('triton')}"
        f"{', ' + peers if peers else ''}.{measured} {record.notes}"
    )
    return f"{head}\n\n{module.summary(record)}\n"


FLOOR_SHARE = 0.85
"""A case under this share of its floor (bytes at the copy bandwidth, or FLOPs at the matmul ceiling,
measured in the same run) is listed (issue #34's target)."""

MEASURED = {"ms", "gpu_ms", "tbps", "tflops", "copy_fraction", "gpu_copy_fraction", "matmul_fraction", "floor_ms",
            "floor_fraction", "peak_mb", "rep", "provider", "status", "measured_utc", "gemm_ms", "gemm_twice_ms"}  # fmt: skip
"""The fields of a row that are measurements (or when: a merged record stamps the rows it kept with
their call's time); the others name the case."""

FLOOR_FIELDS = ("floor_fraction", "copy_fraction", "matmul_fraction")
"""Where a row gives its share of the floor from its wall time ``ms`` (``floor_fraction``: a floor of
bytes and FLOPs together, ``fk.core.bench.floor_ms``)."""


def floor_share(row: dict[str, Any]) -> float | None:
    """The row's share of its floor from its GPU-only time where it has one (``gpu_copy_fraction``,
    or the wall-time share scaled by ``ms / gpu_ms``: at small sizes the wall time is the host's),
    else from its wall time; None where the row gives none."""
    if "gpu_copy_fraction" in row:
        return float(row["gpu_copy_fraction"])
    field = next((f for f in FLOOR_FIELDS if f in row), None)
    if field is None:
        return None
    return float(row[field]) * (float(row["ms"]) / float(row["gpu_ms"]) if "gpu_ms" in row else 1.0)


def _time(row: dict[str, Any], gpu: bool) -> float:
    return float(row["gpu_ms"] if gpu else row["ms"])


def shortfalls(record: bench.BenchRecord) -> list[str]:
    """Every case of ``record`` where fk (provider ``fk``) is slower than the fastest peer (a
    provider not named ``fk...``), and every case where fk is under :data:`FLOOR_SHARE` of its floor.
    Times are GPU-only where fk and the peer both have one, else wall times; records without
    per-call times (end-to-end, multi-GPU) have no cases."""
    cases: dict[tuple[tuple[str, str], ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in record.rows:
        if "ms" in row and "provider" in row:
            key = tuple(sorted((k, str(v)) for k, v in row.items() if k not in MEASURED))
            cases[key][row["provider"]] = row
    lines = []
    for key, by_provider in cases.items():
        fk = by_provider.get("fk")
        if fk is None:
            continue
        name = ", ".join(f"{k}={v}" for k, v in key)
        peers = {p: r for p, r in by_provider.items() if not p.startswith("fk")}
        if peers:
            gpu = "gpu_ms" in fk and all("gpu_ms" in r for r in peers.values())
            best = min(peers, key=lambda p: _time(peers[p], gpu))
            ratio = _time(peers[best], gpu) / _time(fk, gpu)
            if ratio < 0.9995:  # (below 1.000x as printed)
                lines.append(f"{name}: {ratio:.3f}x {best} ({'GPU' if gpu else 'wall'} time)")
        share = floor_share(fk)
        if share is not None and share < FLOOR_SHARE:
            lines.append(f"{name}: {100 * share:.1f}% of the floor")
    return lines


def _shortfalls_section(records: dict[str, bench.BenchRecord]) -> str:
    parts = []
    for name, record in records.items():
        lines = shortfalls(record)
        listed = "\n".join(f"- {line}" for line in lines) if lines else "- none"
        parts.append(
            f"`{name}.json` ({record.environment.get('gpu')}, {record.environment.get('date_utc')}):\n\n{listed}"
        )
    return "\n\n".join(parts) + "\n"


def main() -> None:
    page = PAGE.read_text()
    records = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        name = path.stem
        record = bench.BenchRecord.from_json(path)
        records[name] = record
        pattern = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", re.S)
        if not pattern.search(page):
            print(f"{PAGE.name} has no markers for {name}: skipped")
            continue
        page = pattern.sub(lambda m: m.group(1) + _section(name, record) + m.group(2), page)  # noqa: B023
        print(f"{name}: table written")
    section = _shortfalls_section(records)
    print("Cases behind the fastest peer or under 85% of the floor:\n" + section)
    marker = re.compile(r"(<!-- shortfalls -->\n).*?(<!-- /shortfalls -->)", re.S)
    if marker.search(page):
        page = marker.sub(lambda m: m.group(1) + section + m.group(2), page)
    else:
        print(f"{PAGE.name} has no shortfalls markers: list not written")
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
