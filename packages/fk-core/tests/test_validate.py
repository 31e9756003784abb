from __future__ import annotations

import pytest
import torch

from fk.core import validate


def test_check_tensor() -> None:
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
        validate.check_tensor("x", [1.0])


def test_check_dtype_names_argument_and_choices() -> None:
    with pytest.raises(TypeError, match=r"x must have dtype in \(float32, float16, bfloat16\), got int64"):
        validate.check_dtype("x", torch.zeros(2, dtype=torch.int64))
    validate.check_dtype("x", torch.zeros(2, dtype=torch.bfloat16))


def test_check_same_dtype_and_device() -> None:
    a = torch.zeros(2)
    with pytest.raises(TypeError, match="w must have the dtype of x"):
        validate.check_same_dtype("w", a.half(), "x", a)
    with pytest.raises(ValueError, match="w must be on the device of x"):
        validate.check_same_device("w", torch.zeros(2, device="meta"), "x", a)


def test_shape_checks() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"w must have shape \(3,\), got \(2, 3\)"):
        validate.check_shape("w", x, (3,))
    with pytest.raises(ValueError, match="x must have 1 or 3 dimension"):
        validate.check_ndim("x", x, (1, 3))
    with pytest.raises(ValueError, match="at least 3 dimension"):
        validate.check_min_ndim("x", x, 3)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_positive_float_rejects(bad: float) -> None:
    with pytest.raises(ValueError, match="eps must be > 0"):
        validate.check_positive_float("eps", bad)


def test_positive_float_types() -> None:
    assert validate.check_positive_float("eps", 1) == 1.0
    with pytest.raises(TypeError, match="eps must be a float, got str"):
        validate.check_positive_float("eps", "1e-6")
    with pytest.raises(TypeError):
        validate.check_positive_float("eps", True)


def test_choice_and_width() -> None:
    with pytest.raises(ValueError, match="mode must be one of 'a', 'b', got 'c'"):
        validate.check_choice("mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match="at most 8"):
        validate.check_max_width("x", 9, 8)
