"""Every model type of transformers' causal-LM and image-text-to-text registries, built tiny and
random: fk.hf.apply patches what it recognizes and the probe verifies, with loss and every gradient
equal to stock's (fp32, on CPU through Triton's interpreter), or leaves it stock, and never raises.
(``python -m fk.hf.coverage`` writes the same check as docs/models.md.)"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from fk.hf import coverage  # noqa: E402

CASES = [(registry, t) for registry, types in coverage.registries().items() for t in sorted(types)]


@pytest.mark.parametrize(("registry", "model_type"), CASES, ids=[f"{r}-{t}" for r, t in CASES])
def test_patched_or_left_stock_never_wrong(registry: str, model_type: str, device: str) -> None:
    if device != "cpu":
        pytest.skip("the registry is checked in fp32 on the CPU")
    transformers.logging.set_verbosity_error()
    row = coverage.check(model_type, registry)
    if row.status == "not checked":
        pytest.skip(f"not checked: {row.detail}")
    assert row.status in ("patched", "nothing patched"), f"{row.status}: {row.detail}\n{row.stock}"
