"""Tests for ``fk.core.vendor``: the import rewriting, and vendored trees that import with no fk installed."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from fk.core.vendor import VendorError, main, rewrite_imports, vendor, vendor_packages

# --------------------------------------------------------------------------------------------
# rewrite_imports on source strings
# --------------------------------------------------------------------------------------------

REWRITES = [
    pytest.param(
        "from fk.core.launch import row_tiling\n",
        1,
        "from ..core.launch import row_tiling\n",
        id="single-line",
    ),
    pytest.param("from fk.core import validate\n", 1, "from ..core import validate\n", id="package"),
    pytest.param("from fk.norms.x import y as z\n", 1, "from ..norms.x import y as z\n", id="own-package"),
    pytest.param("from fk import core\n", 1, "from .. import core\n", id="from-fk"),
    pytest.param("from fk.core.launch import row_tiling\n", 2, "from ...core.launch import row_tiling\n", id="depth-2"),
    pytest.param("from fk.core.launch import row_tiling\n", 0, "from .core.launch import row_tiling\n", id="depth-0"),
    pytest.param(
        "from fk.core.launch import (\n    persistent_grid,  # grid\n    row_tiling,\n)\nx = 1\n",
        1,
        "from ..core.launch import (\n    persistent_grid,  # grid\n    row_tiling,\n)\nx = 1\n",
        id="multi-line",
    ),
    pytest.param(
        "def f():\n    if True:\n        from fk.core.ops import define_op  # lazy\n    return define_op\n",
        1,
        "def f():\n    if True:\n        from ..core.ops import define_op  # lazy\n    return define_op\n",
        id="in-function",
    ),
    pytest.param(
        "import os; from fk.core import a; from fk.core.b import c\n",
        1,
        "import os; from ..core import a; from ..core.b import c\n",
        id="semicolons",
    ),
    pytest.param(
        "from  fk . core  import a\nfrom fk.core \\\n    import b\n",
        1,
        "from  ..core  import a\nfrom ..core \\\n    import b\n",
        id="odd-spacing",
    ),
    pytest.param(
        's = "é ü"; from fk.core import a  # ünïcode\n',
        1,
        's = "é ü"; from ..core import a  # ünïcode\n',
        id="non-ascii-before",
    ),
    pytest.param(
        "from fk.core import a\r\nfrom fk.core.b import (\r\n    c,\r\n)\r\n",
        1,
        "from ..core import a\r\nfrom ..core.b import (\r\n    c,\r\n)\r\n",
        id="crlf",
    ),
    pytest.param(
        '"""Docs: from fk.core import x."""\n'
        "# from fk.core import y\n"
        'S = "from fk.core import z"\n'
        "from fkx.core import a\n"
        "from .launch import b\n"
        "from ..fk.core import c\n"
        "import fkx\n",
        1,
        '"""Docs: from fk.core import x."""\n'
        "# from fk.core import y\n"
        'S = "from fk.core import z"\n'
        "from fkx.core import a\n"
        "from .launch import b\n"
        "from ..fk.core import c\n"
        "import fkx\n",
        id="left-alone",
    ),
]


@pytest.mark.parametrize(("source", "depth", "expected"), REWRITES)
def test_rewrite_imports(source: str, depth: int, expected: str) -> None:
    rewritten = rewrite_imports(source, depth)
    assert rewritten == expected
    assert rewrite_imports(rewritten, depth) == rewritten  # nothing left to rewrite


@pytest.mark.parametrize("statement", ["import fk.core.launch", "import fk", "import os, fk.core as c"])
def test_plain_import_of_fk_is_refused(statement: str) -> None:
    source = f'"""Module."""\n\n\ndef f() -> None:\n    {statement}\n'
    with pytest.raises(VendorError, match=r"some/file\.py:5: .*cannot be made relative"):
        rewrite_imports(source, 1, "some/file.py")


def test_syntax_error_names_the_file() -> None:
    with pytest.raises(VendorError, match=r"bad\.py:1: cannot parse"):
        rewrite_imports("from fk.core import (\n", 1, "bad.py")


# --------------------------------------------------------------------------------------------
# Helpers for vendored trees
# --------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")


def _child_env(pythonpath: Path, **extra: str) -> dict[str, str]:
    """The environment of a child interpreter whose only extra import path is ``pythonpath``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(pythonpath)
    env.update(extra)
    return env


# The child must run the vendored copy with no fk importable, wherever fk is installed (editable,
# or into site-packages next to torch as in `nox -s tests`): a finder at the front of
# sys.meta_path refuses `fk` and every `fk.*` module.
_HIDE_FK = textwrap.dedent(
    """
    import sys

    class _NoFk:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "fk" or name.startswith("fk."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the vendoring test)")
            return None

    sys.meta_path.insert(0, _NoFk)
    """
)


def _run_without_fk(code: str, path: Path, **env: str) -> str:
    """Run ``code`` in a fresh interpreter that can import only what is under ``path`` (plus site-packages)."""
    guard = textwrap.dedent(
        """
        try:
            import fk
        except ImportError:
            pass
        else:
            raise AssertionError(f"import fk succeeded: {fk.__path__}")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", _HIDE_FK + guard + textwrap.dedent(code)],
        cwd=path,
        env=_child_env(path, **env),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, f"child failed:\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def _assert_no_fk_imports(root: Path) -> None:
    """No file in the vendored tree still imports fk (text check at line starts, and an AST check)."""
    python_files = sorted(root.rglob("*.py"))
    assert python_files
    for path in python_files:
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            assert not line.startswith(("from fk.", "from fk ", "import fk")), f"{path}:{number}: {line}"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                assert node.module != "fk" and not node.module.startswith("fk."), f"{path}:{node.lineno}"
            if isinstance(node, ast.Import):
                assert not any(a.name == "fk" or a.name.startswith("fk.") for a in node.names), f"{path}:{node.lineno}"


# --------------------------------------------------------------------------------------------
# A synthetic fk tree (two fake kernel packages) vendored and imported without fk
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_fk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Two fake fk packages, ``fk.<a>`` (regular, needs ``fk.<b>``) and ``fk.<b>`` (namespace), on sys.path."""
    tag = uuid.uuid4().hex[:8]
    a, b = f"vendortest_a_{tag}", f"vendortest_b_{tag}"
    src = tmp_path / "src"
    _write(
        src / "fk" / a / "__init__.py",
        f'''\
        """Fake kernel package A (from fk.core import nothing: docstrings stay)."""
        from fk.core.ops import op_namespace
        from fk import core  # the whole core package
        from fk.{b}.helpers import (
            double,  # doubles
        )

        TEXT = "from fk.core import nothing"


        def namespace() -> str:
            return op_namespace(__name__)


        def quadruple(x: int) -> int:
            from fk.{b}.helpers import double as twice

            return twice(double(x))
        ''',
    )
    _write(src / "fk" / a / "data" / "table.json", '{"rows": 1}\n')
    _write(src / "fk" / a / "__pycache__" / "junk.cpython-311.pyc", "not bytecode")
    _write(src / "fk" / a / "stray.pyc", "not bytecode")
    _write(src / "fk" / b / "helpers.py", "def double(x: int) -> int:\n    return 2 * x\n")
    _write(src / "fk" / b / "sub" / "deep.py", f"from fk.{b}.helpers import double\n\nEIGHT = double(4)\n")
    monkeypatch.syspath_prepend(str(src))
    return a, b


def test_vendor_synthetic_tree(tmp_path: Path, fake_fk: tuple[str, str]) -> None:
    a, b = fake_fk
    out = tmp_path / "out"
    result = vendor_packages([f"fk-{a.replace('_', '-')}"], out, name="myvendor")
    root = result.root
    assert root == out / "myvendor"
    assert sorted(p.leaf for p in result.packages) == sorted([a, b, "core"])
    assert {p.leaf: p.reason for p in result.packages} == {a: "requested", b: f"needed by fk.{a}", "core": "always"}

    assert (root / "__init__.py").read_text(encoding="utf-8").startswith('"""Vendored copy of')
    assert (root / a / "data" / "table.json").read_text(encoding="utf-8") == '{"rows": 1}\n'
    assert not (root / a / "__pycache__").exists()
    assert not (root / a / "stray.pyc").exists()
    assert not (root / a / "data" / "__init__.py").exists()  # no Python files there
    assert (root / b / "__init__.py").read_text(encoding="utf-8") == ""  # namespace package made regular
    assert (root / b / "sub" / "__init__.py").exists()
    assert (root / "core" / "vendor.py").exists()

    init_a = (root / a / "__init__.py").read_text(encoding="utf-8")
    assert "from ..core.ops import op_namespace\n" in init_a
    assert "from .. import core  # the whole core package\n" in init_a
    assert f"from ..{b}.helpers import (\n    double,  # doubles\n)\n" in init_a
    assert f"    from ..{b}.helpers import double as twice\n" in init_a
    assert 'TEXT = "from fk.core import nothing"' in init_a
    assert (root / b / "sub" / "deep.py").read_text(encoding="utf-8").startswith(f"from ...{b}.helpers import double")
    _assert_no_fk_imports(root)

    stdout = _run_without_fk(
        f"""
        from myvendor.{a} import namespace, quadruple
        from myvendor.{b}.sub.deep import EIGHT
        assert quadruple(3) == 12
        assert EIGHT == 8
        print(namespace())
        """,
        out,
    )
    assert stdout.strip() == f"myvendor_{a}"


def test_plain_import_in_package_is_refused(tmp_path: Path, fake_fk: tuple[str, str]) -> None:
    a, _ = fake_fk
    bad = tmp_path / "src" / "fk" / a / "bad.py"
    _write(bad, "import os\nimport fk.core.ops\n")
    out = tmp_path / "out"
    with pytest.raises(VendorError, match=rf"{bad.name}:2: `import fk\.core\.ops` cannot be made relative"):
        vendor([a], out)
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


def test_unknown_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no_such_package", "--into", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_package" in err
    assert "core" in err.split("found on the path:")[1]
    assert not any(tmp_path.iterdir())


def test_bad_name(tmp_path: Path) -> None:
    with pytest.raises(VendorError, match="identifier"):
        vendor(["core"], tmp_path, name="not-a-name")


def test_refuses_to_overwrite_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fk-core", "--into", str(tmp_path), "--name", "vend"]) == 0
    assert "vendored into" in capsys.readouterr().out
    stale = tmp_path / "vend" / "stale.txt"
    stale.write_text("old", encoding="utf-8")

    assert main(["core", "--into", str(tmp_path), "--name", "vend"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert stale.exists()

    assert vendor(["core"], tmp_path, name="vend", force=True) == tmp_path / "vend"
    assert not stale.exists()
    assert (tmp_path / "vend" / "core" / "vendor.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vend"]  # no staging directories left behind
    _assert_no_fk_imports(tmp_path / "vend")


# --------------------------------------------------------------------------------------------
# End to end: the real fk.norms, vendored at the top level and inside a package
# --------------------------------------------------------------------------------------------


def _norms_missing() -> bool:
    try:
        spec = importlib.util.find_spec("fk.norms")
    except ImportError:
        return True
    return spec is None or spec.origin is None  # absent, or a directory without __init__.py yet


@pytest.mark.skipif(_norms_missing(), reason="fk.norms is not importable (not written or not on the path yet)")
@pytest.mark.parametrize(
    ("layout", "interpret"),
    [pytest.param("top", "1", id="top-level-kernel"), pytest.param("nested", "0", id="nested-reference")],
)
def test_vendor_norms_end_to_end(tmp_path: Path, layout: str, interpret: str) -> None:
    # The "top" case runs the vendored kernels: compiled on a GPU, else in Triton's interpreter.
    # The "nested" case runs on the CPU without the interpreter: the vendored reference path.
    tensor_device = "cpu"
    if interpret == "1" and torch.cuda.is_available():
        interpret, tensor_device = "0", "cuda"
    if layout == "top":
        into, module = tmp_path, "myvendor"
    else:
        into, module = tmp_path / "outer" / "inner", "outer.inner.myvendor"
        _write(tmp_path / "outer" / "__init__.py", "")
        _write(tmp_path / "outer" / "inner" / "__init__.py", "")
    root = vendor(["norms"], into, name="myvendor")
    assert root == into / "myvendor"
    assert (root / "norms" / "__init__.py").exists()
    assert (root / "core" / "__init__.py").exists()
    _assert_no_fk_imports(root)

    stdout = _run_without_fk(
        f"""
        import torch
        import torch.nn.functional as F
        from {module}.norms import RMSNorm, rms_norm

        torch.manual_seed(0)
        x = torch.randn(3, 5, 64, device="{tensor_device}", requires_grad=True)
        weight = torch.randn(64, device="{tensor_device}", requires_grad=True)
        out = rms_norm(x, weight, eps=1e-6)
        ref_x = x.detach().clone().requires_grad_(True)
        ref_weight = weight.detach().clone().requires_grad_(True)
        ref = F.rms_norm(ref_x, (64,), ref_weight, eps=1e-6)
        torch.testing.assert_close(out, ref)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        torch.testing.assert_close(x.grad, ref_x.grad)
        torch.testing.assert_close(weight.grad, ref_weight.grad)
        assert RMSNorm.__module__.startswith("{module}.norms"), RMSNorm.__module__
        print("ok")
        """,
        tmp_path,
        TRITON_INTERPRET=interpret,
    )
    assert stdout.strip().endswith("ok")


def _lora_missing() -> bool:
    try:
        return importlib.util.find_spec("fk.lora") is None or importlib.util.find_spec("fk.glu") is None
    except ImportError:
        return True


@pytest.mark.skipif(_lora_missing(), reason="fk.lora and fk.glu are not importable here (fk-core alone)")
def test_vendor_command_line_pulls_in_dependencies(tmp_path: Path) -> None:
    """``python -m fk.core.vendor lora --into DIR`` as a user types it: fk-lora needs fk-glu, which
    comes along; the vendored fused LoRA MLP then runs (reference path) with no fk installed."""
    done = subprocess.run(
        [sys.executable, "-m", "fk.core.vendor", "lora", "--into", str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "glu" in done.stdout and "needed by fk.lora" in done.stdout
    root = tmp_path / "fk_vendored"
    assert (root / "glu" / "__init__.py").exists()
    _assert_no_fk_imports(root)
    stdout = _run_without_fk(
        """
        import torch
        from fk_vendored.lora import LoRAWeights, lora_mlp, lora_mlp_ref

        torch.manual_seed(0)
        def part(n, k):
            return LoRAWeights(torch.randn(n, k) / k**0.5, None, torch.randn(4, k, requires_grad=True) / k**0.5,
                               torch.randn(n, 4, requires_grad=True), 2.0)
        x = torch.randn(5, 16)
        parts = (part(24, 16), part(24, 16), part(16, 24))
        torch.testing.assert_close(lora_mlp(x, *parts), lora_mlp_ref(x, *parts))
        print("ok")
        """,
        tmp_path,
        TRITON_INTERPRET="0",
    )
    assert stdout.strip().endswith("ok")
