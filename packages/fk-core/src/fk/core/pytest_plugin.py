"""The pytest plugin every fk test run loads (``-p fk.core.pytest_plugin`` in the root config).

- With no CUDA device, it switches Triton's interpreter on (``TRITON_INTERPRET=1``) before any
  test module imports Triton, so the kernels themselves run on CPU tensors instead of the
  reference path. Set ``TRITON_INTERPRET=0`` yourself to test the reference path instead.
- It registers the ``gpu`` marker: a test marked ``@pytest.mark.gpu`` needs a CUDA device and is
  skipped elsewhere.
- It provides the ``device`` fixture: ``"cuda"`` where a GPU is present, else ``"cpu"``.
- It loads the hypothesis profile ``fk``: property tests draw the same examples on every run, so
  a run (CI's included) can be repeated exactly. ``--hypothesis-profile fk-explore`` draws new
  examples each run, to search further.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from hypothesis import settings
except ImportError:  # fk-core's testing extra brings hypothesis; tests that use it import it anyway
    pass
else:
    settings.register_profile("fk", derandomize=True)
    settings.register_profile("fk-explore", derandomize=False)
    settings.load_profile("fk")  # hypothesis's --hypothesis-profile option, given, loads its profile later


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on machines without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    where = torch.cuda.get_device_name() if HAS_CUDA else "cpu"
    return f"fk: device {where}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"


@pytest.fixture
def device() -> str:
    """The device fk kernels are tested on: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
