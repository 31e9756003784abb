"""Copy fk kernel packages into another project's source tree, so they run there without fk installed.

Usage::

    python -m fk.core.vendor norms --into third_party/ [--name fk_vendored] [--force]

This writes ``third_party/fk_vendored/__init__.py`` (a docstring recording what was copied, from
which versions, and the command that did it) and one subpackage per copied fk package:
``third_party/fk_vendored/core/``, ``third_party/fk_vendored/norms/``. The trainer then imports
``fk_vendored.norms`` (or ``third_party.fk_vendored.norms``, wherever the tree sits).

Rules:

- Packages are named by leaf (``norms``) or by distribution (``fk-norms``); several may be given.
  ``fk.core`` is always copied, and so is every fk package that a copied package needs: those its
  sources import (scanned from the files themselves, the ground truth) plus the ``fk-*``
  requirements of its distribution when that is installed.
- Sources are found through the import system (the packages' ``__path__``), so an installed wheel
  and a checkout on ``PYTHONPATH`` both work. Every file is copied except ``__pycache__`` and
  ``*.pyc``; a copied directory holding Python files but no ``__init__.py`` gets an empty one, so
  that packaging tools which look for ``__init__.py`` find it.
- Imports of fk become relative, so the copy works at the top level or deep inside a package: in
  ``fk_vendored/norms/rms_norm.py`` the statement ``from fk.core.launch import row_tiling`` becomes
  ``from ..core.launch import row_tiling``; ``from fk.norms.x import y`` becomes
  ``from ..norms.x import y``; ``from fk import core`` becomes ``from .. import core``. The rule
  is uniform: one dot per package level between the file and the vendored root, plus one. Imports
  inside functions are rewritten too. Only the module part of each statement changes; comments,
  strings and formatting stay byte-identical.
- ``import fk.core.launch`` (a plain import statement) cannot be made relative, so the command
  refuses such a file, naming the file and line; write ``from fk.core import launch`` instead.
- An existing ``<into>/<name>`` is only replaced with ``--force``.

Op namespaces: fk registers its ``torch.library`` custom ops under a namespace derived from each
module's ``__name__`` (``fk.norms.rms_norm`` gives ``fk_norms_rms_norm``), so a vendored copy
(``fk_vendored.norms.rms_norm``) registers its own ops and can coexist with an installed fk.

From Python: ``vendor(["norms"], Path("third_party"))`` returns the created package directory.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import keyword
import os
import re
import shlex
import shutil
import sys
import tempfile
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "VendorError",
    "VendorResult",
    "VendoredPackage",
    "available_packages",
    "main",
    "rewrite_imports",
    "vendor",
    "vendor_packages",
]

ROOT_PACKAGE = "fk"
ALWAYS_INCLUDED = "core"
DEFAULT_NAME = "fk_vendored"

_SKIP_DIRS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis"})
_SKIP_SUFFIXES = (".pyc", ".pyo")
_PYTHON_SUFFIXES = (".py", ".pyi")
_NEWLINE = re.compile(r"\r\n|\r|\n")
_IMPORT_KEYWORD = re.compile(r"\bimport\b")
_BLANK = r"(?:[ \t\f]|\\(?:\r\n|\r|\n))*"  # whitespace and backslash continuations
_LEADING_BLANK = re.compile(r"\A" + _BLANK)
_TRAILING_BLANK = re.compile(_BLANK + r"\Z")
_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class VendorError(Exception):
    """Vendoring cannot proceed (unknown package, plain ``import fk...``, existing target, ...)."""


@dataclass
class VendoredPackage:
    """One fk package copied into the vendored tree."""

    leaf: str
    """The package's name under ``fk`` (``norms``)."""
    sources: list[Path]
    """The directories it was copied from (one, unless it is a namespace package spread over several)."""
    version: str | None
    """Its distribution's version from installed metadata, or None when not installed."""
    reason: str
    """Why it was copied: ``requested``, ``always``, or ``needed by fk.<leaf>``."""
    files: int = 0
    """How many files were copied (or created) for it."""


@dataclass
class VendorResult:
    """What :func:`vendor_packages` did."""

    root: Path
    """The created package directory, ``<into>/<name>``."""
    packages: list[VendoredPackage]
    """The copied packages, in the order they were resolved (requested ones first)."""
    rewritten_imports: int = 0
    """How many ``from fk... import`` statements were made relative."""
    rewritten_files: int = 0
    """How many files had at least one import rewritten."""
    created_inits: list[Path] = field(default_factory=list)
    """``__init__.py`` files added (relative to ``root``) where a directory of Python files lacked one."""


# --------------------------------------------------------------------------------------------
# Import rewriting
# --------------------------------------------------------------------------------------------


def _is_fk_module(module: str | None) -> bool:
    return module is not None and (module == ROOT_PACKAGE or module.startswith(ROOT_PACKAGE + "."))


def _parse(source: str, filename: str) -> ast.Module:
    try:
        return ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise VendorError(f"{filename}:{exc.lineno}: cannot parse: {exc.msg}") from exc


def _fk_imports(tree: ast.Module, filename: str) -> list[ast.ImportFrom]:
    """The absolute ``from fk... import`` statements anywhere in ``tree``; refuses ``import fk...``."""
    found: list[ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_fk_module(alias.name):
                    raise VendorError(
                        f"{filename}:{node.lineno}: `import {alias.name}` cannot be made relative for vendoring; "
                        f"write it as a `from ... import ...` statement (e.g. `from {_suggest_from(alias.name)}`)"
                    )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_fk_module(node.module):
            found.append(node)
    return found


def _suggest_from(module: str) -> str:
    parent, _, last = module.rpartition(".")
    return f"{parent} import {last}" if parent else f"{module} import ..."


def _line_starts(source: str) -> list[int]:
    """Character offset of the start of each line (index 0 is line 1), splitting as Python does."""
    return [0] + [m.end() for m in _NEWLINE.finditer(source)]


def _relative_module(module: str, depth: int) -> str:
    """``module`` (``fk`` or ``fk.x.y``) as seen from a file ``depth`` package levels below the vendored root."""
    rest = module[len(ROOT_PACKAGE) :].lstrip(".")
    return "." * (depth + 1) + rest


def _rewrite(source: str, depth: int, filename: str) -> tuple[str, int]:
    nodes = _fk_imports(_parse(source, filename), filename)
    if not nodes:
        return source, 0
    starts = _line_starts(source)
    edits: list[tuple[int, int, str]] = []
    for node in nodes:
        assert node.module is not None  # _is_fk_module checked it
        line_start = starts[node.lineno - 1]
        line_end = starts[node.lineno] if node.lineno < len(starts) else len(source)
        # ast columns count UTF-8 bytes; convert to characters of this line.
        column = len(source[line_start:line_end].encode("utf-8")[: node.col_offset].decode("utf-8"))
        begin = line_start + column
        if source[begin : begin + 4] != "from":
            raise VendorError(f"{filename}:{node.lineno}: could not locate the import statement in the source text")
        keyword_match = _IMPORT_KEYWORD.search(source, begin + 4)
        if keyword_match is None:
            raise VendorError(f"{filename}:{node.lineno}: could not locate `import` in the statement")
        # Between `from` and `import` there is only the dotted name, blanks and backslash continuations.
        segment = source[begin + 4 : keyword_match.start()]
        lead = _LEADING_BLANK.match(segment)
        trail = _TRAILING_BLANK.search(segment)
        assert lead is not None and trail is not None  # both patterns match the empty string
        name_start, name_end = begin + 4 + lead.end(), begin + 4 + trail.start()
        written = re.sub(_BLANK, "", source[name_start:name_end])
        if written != node.module:
            raise VendorError(
                f"{filename}:{node.lineno}: expected module {node.module!r} in the statement, found {written!r}"
            )
        edits.append((name_start, name_end, _relative_module(node.module, depth)))
    pieces: list[str] = []
    position = 0
    for start, end, text in sorted(edits):
        pieces += [source[position:start], text]
        position = end
    pieces.append(source[position:])
    return "".join(pieces), len(edits)


def rewrite_imports(source: str, depth: int, filename: str = "<string>") -> str:
    """Rewrite every ``from fk... import`` in ``source`` to a relative import.

    ``depth`` is how many package levels the file sits below the vendored root: 1 for
    ``<root>/norms/rms_norm.py`` (and ``<root>/norms/__init__.py``), 2 for
    ``<root>/norms/sub/x.py``. ``from fk.core.launch import row_tiling`` then becomes
    ``from ..core.launch import row_tiling`` at depth 1. Only the module names change; everything
    else in ``source`` is kept as is. Raises :class:`VendorError` (naming ``filename`` and the
    line) on ``import fk...`` statements, which cannot be made relative, and on syntax errors.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    return _rewrite(source, depth, filename)[0]


def _fk_dependencies(source: str, filename: str) -> list[tuple[str, int]]:
    """The fk leaves that ``source`` imports, with the line of each import."""
    needed: list[tuple[str, int]] = []
    for node in _fk_imports(_parse(source, filename), filename):
        assert node.module is not None
        if node.module == ROOT_PACKAGE:  # from fk import core, norms
            needed += [(alias.name, node.lineno) for alias in node.names if alias.name != "*"]
        else:
            needed.append((node.module.split(".")[1], node.lineno))
    return needed


# --------------------------------------------------------------------------------------------
# Finding fk packages
# --------------------------------------------------------------------------------------------


def _fk_path() -> list[Path]:
    """The directories that make up the ``fk`` namespace package on the current import path."""
    try:
        spec = importlib.util.find_spec(ROOT_PACKAGE)
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _has_python_files(directory: Path) -> bool:
    try:
        return any(p.suffix in _PYTHON_SUFFIXES and p.is_file() for p in directory.iterdir())
    except OSError:
        return False


def available_packages() -> list[str]:
    """The fk packages (leaves under ``fk``) importable from the current path, sorted."""
    leaves: set[str] = set()
    for base in _fk_path():
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for entry in entries:
            if (
                entry.is_dir()
                and entry.name.isidentifier()
                and not entry.name.startswith("_")
                and _has_python_files(entry)
            ):
                leaves.add(entry.name)
    return sorted(leaves)


def _normalize(name: str) -> str:
    """``norms``, ``fk-norms``, ``fk_norms``, ``fk.norms`` -> ``norms``."""
    text = name.strip().lower()
    for separator in "-_.":
        prefix = ROOT_PACKAGE + separator
        if text.startswith(prefix) and len(text) > len(prefix):
            text = text[len(prefix) :]
            break
    return text.replace("-", "_")


def _distribution(leaf: str) -> str:
    return f"{ROOT_PACKAGE}-{leaf.replace('_', '-')}"


def _unknown(name: str, detail: str = "") -> VendorError:
    found = available_packages()
    listing = ", ".join(found) if found else "none (is fk on the import path?)"
    return VendorError(f"unknown fk package {name!r}{detail}; fk packages found on the path: {listing}")


def _package_sources(leaf: str, asked_as: str) -> list[Path]:
    if not leaf.isidentifier() or keyword.iskeyword(leaf):
        raise _unknown(asked_as)
    try:
        spec = importlib.util.find_spec(f"{ROOT_PACKAGE}.{leaf}")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.submodule_search_locations is None:
        raise _unknown(asked_as)
    sources = [Path(p) for p in spec.submodule_search_locations if Path(p).is_dir()]
    if not any(_python_files(source) for source in sources):
        raise _unknown(asked_as, f" (fk.{leaf} holds no Python files)")
    return sources


def _metadata(leaf: str) -> tuple[str | None, list[str]]:
    """Version and ``fk-*`` requirement leaves of ``fk-<leaf>`` if installed, else ``(None, [])``."""
    dist = _distribution(leaf)
    try:
        version = importlib.metadata.version(dist)
        requirements = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None, []
    leaves = []
    for requirement in requirements:
        requirement_name, _, marker = requirement.partition(";")
        if "extra" in marker:  # optional extras are not needed to run the package
            continue
        match = _REQUIREMENT_NAME.match(requirement_name)
        if match is None:
            continue
        normalized = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        if normalized.startswith(ROOT_PACKAGE + "-"):
            leaves.append(normalized[len(ROOT_PACKAGE) + 1 :].replace("-", "_"))
    return version, leaves


def _skipped_dir(name: str) -> bool:
    return name in _SKIP_DIRS or name.endswith(".egg-info")


def _walk(source: Path) -> list[Path]:
    """The files under ``source`` to copy, relative to it, skipping caches."""
    files: list[Path] = []
    for directory, subdirs, names in os.walk(source):
        subdirs[:] = sorted(d for d in subdirs if not _skipped_dir(d))
        here = Path(directory).relative_to(source)
        files += [here / n for n in sorted(names) if not n.endswith(_SKIP_SUFFIXES)]
    return files


def _python_files(source: Path) -> list[Path]:
    return [f for f in _walk(source) if f.suffix in _PYTHON_SUFFIXES]


def _merged_files(sources: Sequence[Path]) -> dict[Path, Path]:
    """Relative path -> source file, over all portions of a package (the first portion wins)."""
    merged: dict[Path, Path] = {}
    for source in sources:
        for relative in _walk(source):
            merged.setdefault(relative, source / relative)
    return merged


def _read_source(path: Path) -> tuple[str, str]:
    """Text and encoding of a Python file, keeping its line endings."""
    raw = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(iter(raw.splitlines(keepends=True)).__next__)
    try:
        return raw.decode(encoding), encoding
    except UnicodeDecodeError as exc:
        raise VendorError(f"{path}: cannot decode as {encoding}: {exc}") from exc


def _resolve(requested: Sequence[str]) -> list[VendoredPackage]:
    """The requested packages plus fk.core and everything they need, with their sources."""
    if not requested:
        raise VendorError("name at least one fk package to vendor")
    packages: dict[str, VendoredPackage] = {}
    queue: list[tuple[str, str, str]] = []  # (leaf, how it was named, reason)
    for name in requested:
        queue.append((_normalize(name), name, "requested"))
    queue.append((ALWAYS_INCLUDED, ALWAYS_INCLUDED, "always"))
    while queue:
        leaf, asked_as, reason = queue.pop(0)
        if leaf in packages:
            continue
        sources = _package_sources(leaf, asked_as)
        version, required = _metadata(leaf)
        package = VendoredPackage(leaf=leaf, sources=sources, version=version, reason=reason)
        packages[leaf] = package
        needed_by = f"needed by {ROOT_PACKAGE}.{leaf}"
        for dependency in required:
            queue.append((dependency, f"{_distribution(dependency)} (required by {_distribution(leaf)})", needed_by))
        for path in _merged_files(sources).values():
            if path.suffix not in _PYTHON_SUFFIXES:
                continue
            text, _ = _read_source(path)
            for dependency, line in _fk_dependencies(text, str(path)):
                queue.append((dependency, f"{ROOT_PACKAGE}.{dependency} (imported at {path}:{line})", needed_by))
    return list(packages.values())


# --------------------------------------------------------------------------------------------
# Writing the vendored tree
# --------------------------------------------------------------------------------------------


def _command(packages: Sequence[str], into: Path, name: str) -> str:
    return shlex.join(["python", "-m", "fk.core.vendor", *packages, "--into", str(into), "--name", name])


def _root_init(packages: Sequence[VendoredPackage], command: str) -> str:
    names = ", ".join(f"{ROOT_PACKAGE}.{p.leaf}" for p in packages)
    versions = ", ".join(
        f"{_distribution(p.leaf)} {p.version}"
        if p.version
        else f"{_distribution(p.leaf)} (version unknown: not installed)"
        for p in packages
    )
    text = (
        f"Vendored copy of {names}.\n\n"
        f"Copied from {versions} by fk's vendoring command:\n\n"
        f"    {command}\n\n"
        "Imports between the copied packages were rewritten to relative imports. Do not edit this tree by\n"
        "hand: run the command again with --force to update it.\n"
    )
    escaped = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return f'"""{escaped}"""\n'


def _within(path: Path, directory: Path) -> bool:
    try:
        path.relative_to(directory)
    except ValueError:
        return False
    return True


def _build(packages: Sequence[VendoredPackage], root: Path, result: VendorResult) -> None:
    for package in packages:
        target = root / package.leaf
        target.mkdir()
        files = _merged_files(package.sources)
        for relative, path in files.items():
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix in _PYTHON_SUFFIXES:
                text, encoding = _read_source(path)
                depth = len(relative.parts)  # the package `<root>.<leaf>` is depth 1, its subpackages deeper
                text, count = _rewrite(text, depth, str(path))
                if count:
                    result.rewritten_imports += count
                    result.rewritten_files += 1
                destination.write_bytes(text.encode(encoding))
            else:
                shutil.copyfile(path, destination)
            package.files += 1
        # Directories of Python files without __init__.py (namespace packages) become regular packages.
        python_dirs = {relative.parent for relative in files if relative.suffix in _PYTHON_SUFFIXES}
        for directory in sorted(python_dirs):
            for level in [directory, *directory.parents]:
                init = target / level / "__init__.py"
                if not init.exists():
                    init.write_text("", encoding="utf-8")
                    result.created_inits.append(init.relative_to(root))
                    package.files += 1


def vendor_packages(
    packages: Sequence[str], into: Path | str, name: str = DEFAULT_NAME, force: bool = False
) -> VendorResult:
    """Like :func:`vendor`, but returns a :class:`VendorResult` describing what was copied."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise VendorError(f"--name must be a valid Python identifier, got {name!r}")
    into = Path(into)
    resolved = _resolve(packages)
    into_abs = into.resolve()
    for package in resolved:
        for source in package.sources:
            if _within(into_abs, source.resolve()):
                raise VendorError(f"cannot vendor into {into}: it lies inside the copied sources ({source})")
    root = into / name
    for package in resolved:
        for source in package.sources:
            if _within(source.resolve(), (into_abs / name)):
                raise VendorError(f"cannot vendor to {root}: the copied sources ({source}) lie inside it")
    if (root.exists() or root.is_symlink()) and not force:
        raise VendorError(f"{root} already exists; pass --force (force=True) to replace it")
    into.mkdir(parents=True, exist_ok=True)
    requested_leaves = [p.leaf for p in resolved if p.reason == "requested"]
    result = VendorResult(root=root, packages=resolved)
    # Build next to the target and move it into place at the end, so a failure leaves nothing half-written.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=into))
    try:
        build_root = staging / name
        build_root.mkdir()
        (build_root / "__init__.py").write_text(
            _root_init(resolved, _command(requested_leaves, into, name)), encoding="utf-8"
        )
        _build(resolved, build_root, result)
        if root.is_symlink() or root.is_file():
            root.unlink()
        elif root.exists():
            shutil.rmtree(root)
        build_root.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def vendor(packages: list[str], into: Path, name: str = DEFAULT_NAME, force: bool = False) -> Path:
    """Copy ``packages`` (leaf or distribution names), fk.core and their fk dependencies to ``into/name``.

    Imports of fk in the copies become relative (see the module docstring). Returns the created
    package directory. Raises :class:`VendorError` on unknown packages, ``import fk...``
    statements, or an existing target when ``force`` is False.
    """
    return vendor_packages(packages, into, name, force).root


def _summary(result: VendorResult) -> str:
    lines = [f"vendored into {result.root}:"]
    width = max(len(p.leaf) for p in result.packages)
    for package in result.packages:
        version = f"{_distribution(package.leaf)} {package.version or '(version unknown)'}"
        lines.append(
            f"  {package.leaf:<{width}}  {package.files:3d} files  ({version}; {package.reason}; "
            f"from {', '.join(str(s) for s in package.sources)})"
        )
    lines.append(f"  rewrote {result.rewritten_imports} fk imports to relative in {result.rewritten_files} files")
    if result.created_inits:
        lines.append(
            f"  added {len(result.created_inits)} missing __init__.py: {', '.join(map(str, result.created_inits))}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m fk.core.vendor <package>... --into <dir>``. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m fk.core.vendor",
        description="Copy fk kernel packages (plus fk.core and their fk dependencies) into another source tree, "
        "rewriting fk imports to relative imports.",
    )
    parser.add_argument("packages", nargs="+", metavar="package", help="leaf (norms) or distribution (fk-norms) name")
    parser.add_argument("--into", type=Path, required=True, help="directory that receives the vendored package")
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"name of the vendored package (default {DEFAULT_NAME})")
    parser.add_argument("--force", action="store_true", help="replace <into>/<name> if it exists")
    args = parser.parse_args(argv)
    try:
        result = vendor_packages(args.packages, args.into, args.name, args.force)
    except VendorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
