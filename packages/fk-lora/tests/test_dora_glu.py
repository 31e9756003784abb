"""fk.lora.dora_glu against float64: ``h`` of a DoRA MLP formed from gate's and up's ``z``, and gate's
and up's DoRA terms (``dmag``, ``db``, ``ms * d``) from ``dh`` in one pass."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.lora.dora_glu import (
    ScaledProjection,
    dora_gated_act,
    dora_gated_act_grad_terms,
    dora_gated_act_grad_terms_ref,
    dora_gated_act_grad_terms_torch,
    dora_gated_act_ref,
    dora_gated_act_torch,
)

SHAPES = [(1, 1), (7, 130), (37, 257), (45, 600)]  # (M, I): odd rows, widths not a power of two
ACTIVATIONS = ["silu", "gelu_tanh", "gelu"]


def _projection(m: int, n: int, dtype: torch.dtype, device: str, seed: int, with_bias: bool) -> ScaledProjection:
    z = testing.random_tensor((m, n), dtype, device, seed=seed)
    ms = testing.random_tensor((n,), torch.float32, device, seed=seed + 1, scale=0.3, offset=1.0)
    norm = testing.random_tensor((n,), torch.float32, device, seed=seed + 2, scale=0.2, offset=2.0)
    bias = testing.random_tensor((n,), dtype, device, seed=seed + 3) if with_bias else None
    return ScaledProjection(z, ms, norm, bias)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_gated_act_matches_reference(
    device: str, dtype: torch.dtype, m: int, n: int, with_bias: bool, activation: str
) -> None:
    gate, up = (_projection(m, n, dtype, device, seed, with_bias) for seed in (0, 10))
    h = dora_gated_act(gate, up, activation)
    assert h.dtype == dtype and h.shape == (m, n)
    testing.assert_close(
        h, dora_gated_act_ref(gate, up, activation), dora_gated_act_torch(gate, up, activation), name="h"
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_grad_terms_match_reference(
    device: str, dtype: torch.dtype, m: int, n: int, with_bias: bool, activation: str
) -> None:
    gate, up = (_projection(m, n, dtype, device, seed, with_bias) for seed in (0, 10))
    dh = testing.random_tensor((m, n), dtype, device, seed=20)
    bias_dtype = dtype if with_bias else None
    dtypes = ((torch.float32, bias_dtype), (dtype, bias_dtype))  # the magnitudes in fp32 and in the dtype
    got = dora_gated_act_grad_terms(dh, gate, up, activation, dtypes)
    baseline = dora_gated_act_grad_terms_torch(dh, gate, up, activation, dtypes)
    for which, g, want, b in zip(("gate", "up"), got, dora_gated_act_grad_terms_ref(dh, gate, up, activation), baseline, strict=True):  # fmt: skip
        assert g.dy_ms1 is None and (g.bias is None) == (not with_bias)
        for name, value, ref, base in zip(("dmag", "db", "dy_ms"), (g.magnitude, g.bias, g.dy_ms), want, (b.magnitude, b.bias, b.dy_ms), strict=True):  # fmt: skip
            if value is None:
                continue
            assert base is not None and value.dtype == base.dtype
            testing.assert_close(value, ref, base, name=f"{which} {name}")
    assert got[0].magnitude.dtype == torch.float32 and got[1].magnitude.dtype == dtype


def test_grad_terms_form_only_the_sums_asked_for(device: str) -> None:
    gate, up = (_projection(37, 257, torch.bfloat16, device, seed, True) for seed in (0, 10))
    dh = testing.random_tensor((37, 257), torch.bfloat16, device, seed=21)
    terms_g, terms_u = dora_gated_act_grad_terms(dh, gate, up, "silu", ((None, None), (torch.float32, None)))
    assert terms_g.magnitude is None and terms_g.bias is None and terms_g.dy_ms is not None
    assert terms_u.magnitude is not None and terms_u.bias is None
    want = dora_gated_act_grad_terms_ref(dh, gate, up, "silu")[1]
    base = dora_gated_act_grad_terms_torch(dh, gate, up, "silu", ((None, None), (torch.float32, None)))[1]
    assert base.magnitude is not None
    testing.assert_close(terms_u.magnitude, want[0], base.magnitude, name="up dmag")
    only_db = dora_gated_act_grad_terms(dh, gate, up, "silu", ((None, torch.float32), (None, None)))
    assert only_db[0].bias is not None and only_db[0].magnitude is None and only_db[1].bias is None


def test_grad_terms_read_a_gradient_with_a_row_stride(device: str) -> None:
    gate, up = (_projection(33, 130, torch.bfloat16, device, seed, False) for seed in (0, 10))
    dh = testing.random_tensor((33, 200), torch.bfloat16, device, seed=22)[:, :130]
    dtypes = ((torch.float32, None), (torch.float32, None))
    got = dora_gated_act_grad_terms(dh, gate, up, "silu", dtypes)
    baseline = dora_gated_act_grad_terms_torch(dh.contiguous(), gate, up, "silu", dtypes)
    for g, want, b in zip(got, dora_gated_act_grad_terms_ref(dh, gate, up, "silu"), baseline, strict=True):
        assert g.magnitude is not None and b.magnitude is not None and g.dy_ms is not None and b.dy_ms is not None
        testing.assert_close(g.magnitude, want[0], b.magnitude, name="dmag")
        testing.assert_close(g.dy_ms, want[2], b.dy_ms, name="dy_ms")
