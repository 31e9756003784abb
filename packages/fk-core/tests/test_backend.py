from __future__ import annotations

import os
import subprocess
import sys

import torch

from fk.core import backend


def test_cpu_path_follows_the_interpreter_switch() -> None:
    expected = backend.KernelPath.INTERPRETER if backend.INTERPRETER_ON else backend.KernelPath.REFERENCE
    assert backend.kernel_path(torch.zeros(1)) is expected
    assert backend.uses_kernel(torch.zeros(1)) == backend.INTERPRETER_ON


def _path_in_fresh_process(interpret: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    code = "import torch; from fk.core import backend; print(backend.kernel_path(torch.zeros(1)).value)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_fresh_process_without_interpreter_takes_reference() -> None:
    assert _path_in_fresh_process("0").strip() == "reference"


def test_fresh_process_with_interpreter_takes_interpreter() -> None:
    assert _path_in_fresh_process("1").strip() == "interpreter"
