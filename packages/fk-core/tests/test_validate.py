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


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bad", [300, -1, 2**31 - 1])
def test_check_labels_names_the_first_bad_label_its_value_and_position(dtype: torch.dtype, bad: int) -> None:
    labels = torch.zeros(2, 9, dtype=dtype)
    labels[0, 2] = -100
    labels[1, 7] = bad
    labels[1, 8] = 301  # a later bad label: the first one in row-major order is named
    message = rf"labels\[1, 7\] = {bad} is outside \[0, 300\) and is not ignore_index \(-100\)"
    with pytest.raises(ValueError, match=message):
        validate.check_labels("labels", labels, 300, -100)


def test_check_labels_accepts_the_range_and_ignore_index_and_compares_without_wrapping() -> None:
    validate.check_labels("labels", torch.tensor([0, 299, -100, 5]), 300, -100)
    validate.check_labels("labels", torch.tensor([0, 299, 300]), 300, 300)  # ignore_index outside the range
    validate.check_labels("labels", torch.empty(0, dtype=torch.long), 300, -100)
    # 2**32 would wrap to 0 if compared with the int32 labels in int32.
    with pytest.raises(ValueError, match=r"labels\[0\] = 0 is outside \[0, 0\)"):
        validate.check_labels("labels", torch.zeros(1, dtype=torch.int32), 0, 2**32)
    with pytest.raises(ValueError, match=r"^labels = 7 is outside"):
        validate.check_labels("labels", torch.tensor(7), 5, -100)


def test_check_labels_skips_labels_before_scored_from() -> None:
    labels = torch.tensor([[999, 1, 2], [3, 4, 999]])
    validate.check_labels("labels", labels[:1], 5, -100, scored_from=1)  # a causal shift never scores [.., 0]
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = 999"):
        validate.check_labels("labels", labels, 5, -100, scored_from=1)


def test_fk_check_labels_sets_where_labels_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    monkeypatch.delenv("FK_CHECK_LABELS", raising=False)
    assert validate.labels_checked_on(cpu) and not validate.labels_checked_on(cuda)
    monkeypatch.setenv("FK_CHECK_LABELS", "")
    assert validate.labels_checked_on(cpu) and not validate.labels_checked_on(cuda)
    monkeypatch.setenv("FK_CHECK_LABELS", "1")
    assert validate.labels_checked_on(cpu) and validate.labels_checked_on(cuda) and not validate.labels_checked_on(meta)
    monkeypatch.setenv("FK_CHECK_LABELS", "0")
    assert not validate.labels_checked_on(cpu) and not validate.labels_checked_on(cuda)
    validate.check_labels("labels", torch.tensor([5]), 5, -100)  # unchecked: no error
    monkeypatch.setenv("FK_CHECK_LABELS", "yes")
    with pytest.raises(ValueError, match=r"FK_CHECK_LABELS must be 1 .*, 0 .* or unset .*, got 'yes'"):
        validate.labels_checked_on(cpu)


def test_check_labels_is_skipped_while_compiling() -> None:
    def loss(labels: torch.Tensor) -> torch.Tensor:
        validate.check_labels("labels", labels, 5, -100)
        return labels.sum()

    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    assert compiled(torch.tensor([1, 7])).item() == 8  # traced whole, and the compiled code does not check


def test_check_int_names_the_argument() -> None:
    assert validate.check_int("n", 3, 1) == 3
    with pytest.raises(TypeError, match="n must be an int, got bool"):
        validate.check_int("n", True)
    with pytest.raises(TypeError, match="n must be an int, got float"):
        validate.check_int("n", 3.0)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        validate.check_int("n", 0, 1)
