from __future__ import annotations

import sys
from pathlib import Path

from fk.hf import check

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, which the testing extra installs there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_check_runs_every_installed_kernel_and_passes() -> None:
    rows = check.run([check.torch.float32])
    assert {r["kernel"] for r in rows} == {c.name for c in check.available_cases()}
    assert rows and all(r["check"] == "ok" for r in rows), rows


def test_check_main_exit_code() -> None:
    assert check.main(["--dtypes", "bfloat16"]) == 0


def test_versions_move_in_lockstep() -> None:
    """VERSION is the one source of truth: every distribution and every fk pin must match it."""
    version = (ROOT / "VERSION").read_text().strip()
    for pyproject in [*sorted((ROOT / "packages").glob("*/pyproject.toml")), ROOT / "meta" / "pyproject.toml"]:
        project = tomllib.loads(pyproject.read_text())["project"]
        assert project["version"] == version, pyproject
        for requirement in project.get("dependencies", []):
            if requirement.startswith("fk-"):
                assert requirement.endswith(f"=={version}"), (pyproject, requirement)


def test_meta_depends_on_every_kernel_package() -> None:
    meta = tomllib.loads((ROOT / "meta" / "pyproject.toml").read_text())["project"]
    pinned = {r.split("==")[0] for r in meta["dependencies"]}
    packages = {p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")}
    assert pinned == packages


def test_distribution_names_match_their_imports() -> None:
    """fk-<leaf> ships fk.<leaf>: the kernel packages by their directory, the meta-package as fk-hf
    (``fk`` on PyPI is an unrelated project)."""
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        assert tomllib.loads(pyproject.read_text())["project"]["name"] == pyproject.parent.name
    meta = tomllib.loads((ROOT / "meta" / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "fk-hf"
    assert (ROOT / "meta" / "src" / "fk" / "hf" / "__init__.py").exists()
