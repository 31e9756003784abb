"""Every task of the fk monorepo: `nox -l` lists them, `nox -s NAME` runs one.

CPU sessions install torch from the package index (pin with FK_TORCH, default ``torch==2.13.0``;
that pin takes a CPU-only wheel where the index offers one) and run the kernels in Triton's
interpreter. The ``gpu`` and ``bench`` sessions run in the current interpreter without
installing anything, for a GPU machine whose Python already has torch, triton and the peers.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
META = ROOT / "meta"
ALL_DISTS = [*PACKAGES, META]
TORCH = os.environ.get("FK_TORCH", "torch==2.13.0")
# Triton 3.6 is what the GPU machines run; its interpreter needs numpy < 2.4 (it calls int() on
# one-element arrays, which numpy 2.4 rejects).
TRITON = os.environ.get("FK_TRITON", "triton==3.6.0")
CPU_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _leaf(dist: Path) -> str:
    """``packages/fk-norms`` -> ``norms``; ``meta`` -> ``hf``."""
    return "hf" if dist == META else dist.name.removeprefix("fk-")


def _install_runtime(session: nox.Session) -> None:
    session.install(TORCH, TRITON)


def _project(dist: Path) -> dict[str, Any]:
    """The ``[project]`` table of a distribution's pyproject.toml."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: nox itself depends on tomli there
        import tomli as tomllib

    project: dict[str, Any] = tomllib.loads((dist / "pyproject.toml").read_text())["project"]
    return project


def _extra(dist: Path, name: str) -> list[str]:
    """The requirements of the extra ``name`` of a distribution (``[]`` when it has none)."""
    requirements: list[str] = _project(dist).get("optional-dependencies", {}).get(name, [])
    return requirements


def _local_dependencies(dist: Path) -> list[Path]:
    """The fk distributions of this repository that ``dist`` needs, read from the dependencies its
    pyproject.toml declares, and theirs (fk-core aside, which the sessions install with its
    extras): fk-align's fk-flce, fk-lora's fk-glu, every kernel package for the meta-package. They
    are not on the package index yet, so the sessions install them from here, in one pip command."""
    local = {p.name: p for p in PACKAGES}
    found: list[Path] = []
    pending = [dist]
    while pending:
        requirements = _project(pending.pop()).get("dependencies", [])
        for name in (re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0] for req in requirements):
            if name in local and name != "fk-core" and local[name] not in found:
                found.append(local[name])
                pending.append(local[name])
    return found


def _test_extras(dist: Path) -> list[str]:
    """The ``testing`` extra of a distribution other than fk-core (fk-lora: peft, transformers; fk-hf: transformers)."""
    return [] if dist.name == "fk-core" else _extra(dist, "testing")


def _install_test_extras(session: nox.Session, dists: list[Path]) -> None:
    """Install the test extras of ``dists`` with torch pinned, so pip never swaps the CPU torch."""
    extras = [req for d in dists for req in _test_extras(d)]
    if extras:
        session.install(*extras, TORCH, "numpy<2.4")


def _src_paths() -> str:
    return os.pathsep.join(str(d / "src") for d in ALL_DISTS)


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's tests in one environment, on CPU through Triton's interpreter.

    Two passes, as :func:`gpu`'s: every test but the ``serial`` ones across ``FK_CPU_WORKERS`` xdist
    workers (default: one a CPU; each with one torch thread, the interpreter's Python being the
    work), then the ``serial`` ones alone (heavy subprocesses). Extra arguments go to both passes.
    """
    _install_runtime(session)
    core = ROOT / "packages" / "fk-core"  # (not PACKAGES[0]: fk-align sorts before it)
    session.install(f"{core}[testing,bench]", "pytest-xdist")
    _install_test_extras(session, ALL_DISTS)
    session.install("--no-deps", *(str(d) for d in ALL_DISTS))
    workers = os.environ.get("FK_CPU_WORKERS", str(os.cpu_count() or 1))
    parallel_env = {**CPU_ENV, "OMP_NUM_THREADS": "1"}
    session.run("pytest", "-n", workers, "--dist", "worksteal", "-m", "not serial", *session.posargs, env=parallel_env)
    session.run("pytest", "-m", "serial", *session.posargs, env=CPU_ENV, success_codes=[0, 5])  # (5: none selected)


@nox.session
@nox.parametrize("dist", [d.name for d in ALL_DISTS])
def tests_isolated(session: nox.Session, dist: str) -> None:
    """One package alone, with only its declared dependencies (plus fk-core's test extra)."""
    path = next(d for d in ALL_DISTS if d.name == dist)
    _install_runtime(session)
    # The fk distributions are not on the index yet: install the local ones this one depends on,
    # then the package itself with its declared dependencies resolved normally.
    session.install(f"{ROOT / 'packages' / 'fk-core'}[testing,bench]")
    local = _local_dependencies(path)
    if local:
        session.install(*(str(p) for p in local))
    _install_test_extras(session, [path])
    session.install(str(path), TORCH)
    tests_dir = path / "tests"
    session.run("pytest", str(tests_dir), *session.posargs, env=CPU_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    _install_runtime(session)
    session.install("mypy==2.4.1", "pytest", "hypothesis", "numpy<2.4", "matplotlib")
    session.run("mypy", *(str(d / "src" / "fk" / _leaf(d)) for d in ALL_DISTS), env={"MYPYPATH": _src_paths()})


@nox.session
def build(session: nox.Session) -> None:
    """Wheel and sdist for every distribution; each wheel holds only its own leaf of ``fk``."""
    session.install("build", "hatchling")
    dist_dir = ROOT / "dist"
    shutil.rmtree(dist_dir, ignore_errors=True)
    for dist in ALL_DISTS:
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist_dir), str(dist), silent=True)
    wheels = sorted(dist_dir.glob("*.whl"))
    if len(wheels) != len(ALL_DISTS) or len(list(dist_dir.glob("*.tar.gz"))) != len(ALL_DISTS):
        session.error(f"expected a wheel and an sdist per distribution, got {[p.name for p in dist_dir.iterdir()]}")
    for dist in ALL_DISTS:
        name = "fk_hf" if dist == META else dist.name.replace("-", "_")
        (wheel,) = [w for w in wheels if w.name.split("-")[0] == name]
        files = zipfile.ZipFile(wheel).namelist()
        own = f"fk/{_leaf(dist)}/"
        stray = [f for f in files if not (f.startswith(own) or ".dist-info/" in f)]
        if stray or "fk/__init__.py" in files or not any(f.startswith(own) for f in files):
            session.error(f"{wheel.name}: files outside {own}: {stray}")
        session.log(f"{wheel.name}: {len(files)} files, all under {own}")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, built with --strict (broken links fail)."""
    session.install("mkdocs==1.6.1")
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))


@nox.session
def demo(session: nox.Session) -> None:
    """The demo: a small Llama trained stock and patched by fk.hf, side by side (``-- --lora``: PEFT LoRA)."""
    _install_runtime(session)
    session.install(*_extra(META, "demo"), TORCH, "numpy<2.4")  # transformers, peft, matplotlib
    session.install("--no-deps", *(str(d) for d in ALL_DISTS))
    session.run("python", "-m", "fk.hf.demo", *session.posargs)


@nox.session
def check(session: nox.Session) -> None:
    """Every fk kernel against its reference (and timed against eager PyTorch on a GPU)."""
    _install_runtime(session)
    session.install("numpy<2.4")
    session.install("--no-deps", *(str(d) for d in ALL_DISTS))
    session.run("python", "-m", "fk.hf.check", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The full test suite, `gpu` tests included, in the current interpreter (no install).

    Two passes: every test but the ``serial`` ones across ``FK_GPU_WORKERS`` xdist workers (default
    14, each taking the next test as it frees up) sharing the one GPU, then the ``serial`` ones alone (they assert timings, which the other
    workers' kernels would stretch, or start heavy subprocesses). Extra arguments go to both passes.
    """
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [_src_paths(), os.environ.get("PYTHONPATH")])),
           # Inductor's own pool of compile processes in every worker oversubscribes the host: three
           # torch.compile tests took 220-240 s each under 14 workers (2026-11-27, H200, 16 cores).
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # fmt: skip
    workers = os.environ.get("FK_GPU_WORKERS", "14")
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    session.run(*pytest, "-n", workers, "--dist", "worksteal", "-m", "not serial", *session.posargs, env=env)
    session.run(*pytest, "-m", "serial", *session.posargs, env=env)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Every benchmark script on the GPU, in the current interpreter; results under benchmarks/results."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [_src_paths(), os.environ.get("PYTHONPATH")]))}
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        session.run(sys.executable, str(script), *session.posargs, env=env)
