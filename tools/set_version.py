"""Set the version of every fk distribution from VERSION (the one source of truth).

    python tools/set_version.py            # write VERSION's version everywhere
    python tools/set_version.py 0.2.0      # bump VERSION, then write it everywhere

Rewrites ``version = "..."`` in every packages/*/pyproject.toml and meta/pyproject.toml, and every
``fk-*==...`` pin in their dependencies. meta/tests/test_check.py fails when they drift apart.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    version_file = ROOT / "VERSION"
    if argv:
        version_file.write_text(argv[0].strip() + "\n")
    version = version_file.read_text().strip()
    for pyproject in [*sorted((ROOT / "packages").glob("*/pyproject.toml")), ROOT / "meta" / "pyproject.toml"]:
        text = pyproject.read_text()
        text = re.sub(r'(?m)^version = "[^"]*"', f'version = "{version}"', text, count=1)
        text = re.sub(r'"(fk-[a-z]+)==[^"]*"', rf'"\1=={version}"', text)
        pyproject.write_text(text)
        print(f"{pyproject.relative_to(ROOT)}: {version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
