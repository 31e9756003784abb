"""Rebuild the tables of docs/benchmarks.md from the committed JSON records (no GPU needed).

    python benchmarks/report.py

For each ``benchmarks/results/<name>.json`` it imports ``benchmarks/bench_<name>.py`` and calls its
``summary(record)``; the tables land between the ``<!-- results:<name> -->`` and
``<!-- /results:<name> -->`` markers of docs/benchmarks.md, with the GPU, versions and date of the
run, so the page never quotes a number that is not in a committed record.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from fk.core import bench

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"


def _section(name: str, record: bench.BenchRecord) -> str:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"bench_{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = record.environment
    peers = ", ".join(f"{k} {v}" for k, v in sorted((env.get("peers") or {}).items()) if v)
    ceilings = record.ceilings
    head = (
        f"Measured on {env.get('gpu')} on {env.get('date_utc')}, torch {env.get('torch')}, triton {env.get('triton')}"
        f"{', ' + peers if peers else ''}. Ceilings in the same run: copy {ceilings.get('copy_tbps', 0):.2f} TB/s, "
        f"bf16 matmul {ceilings.get('matmul_tflops', 0):.0f} TFLOP/s. {record.notes}"
    )
    return f"{head}\n\n{module.summary(record)}\n"


def main() -> None:
    page = PAGE.read_text()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        name = path.stem
        record = bench.BenchRecord.from_json(path)
        pattern = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", re.S)
        if not pattern.search(page):
            print(f"{PAGE.name} has no markers for {name}: skipped")
            continue
        page = pattern.sub(lambda m: m.group(1) + _section(name, record) + m.group(2), page)  # noqa: B023
        print(f"{name}: table written")
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
