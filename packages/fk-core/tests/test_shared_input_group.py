"""fk.core.forward.SharedInputGroup: outputs handed out by the first member, taken by the others."""

from __future__ import annotations

import torch

from fk.core.forward import SharedInputGroup


def _group() -> tuple[SharedInputGroup, list[torch.nn.Module]]:
    members: list[torch.nn.Module] = [torch.nn.Identity() for _ in range(3)]
    return SharedInputGroup(members), members


def test_members_take_their_own_output_of_the_same_input() -> None:
    group, (_q, k, v) = _group()
    x = torch.zeros(2)
    assert group.hand_out(x, ["q", "k", "v"]) == "q"
    assert group.take(v, x) == (True, "v")  # in any order
    assert group.take(k, x) == (True, "k")
    assert group.take(k, x) == (False, None)  # taken once
    assert not group.split and not group.pending


def test_another_input_or_more_arguments_split_the_group() -> None:
    group, (_q, k, _v) = _group()
    x = torch.zeros(2)
    group.hand_out(x, ["q", "k", "v"])
    assert group.take(k, torch.zeros(2)) == (False, None)  # equal values, another tensor
    assert group.split and not group.pending  # v's output is dropped too
    group.split = False
    group.hand_out(x, ["q", "k", "v"])
    assert group.take(k, x, input_alone=False) == (False, None)
    assert group.split


def test_a_new_hand_out_replaces_outputs_not_taken() -> None:
    group, (q, k, v) = _group()
    x, y = torch.zeros(2), torch.ones(2)
    group.hand_out(x, ["q", "k", "v"])
    group.hand_out(y, ["q2", "k2", "v2"])
    assert group.take(k, y) == (True, "k2")
    assert group.take(v, y) == (True, "v2")
    assert group.take(q, y) == (False, None)  # the first member never takes


def test_a_swapped_forward_wrapped_by_init_subclass_is_still_recognised() -> None:
    """transformers' GradientCheckpointingLayer wraps the forward of every subclass (functools.wraps),
    the one swap_forward makes included: the class is still recognised as swapped, and restored."""
    import functools

    from fk.core.forward import restore_class, stock_forward, swap_forward, swapped

    class Wrapping(torch.nn.Module):
        def __init_subclass__(cls, **kwargs: object) -> None:
            super().__init_subclass__()
            inner = cls.forward

            @functools.wraps(inner)
            def wrapped(self: torch.nn.Module, *args: object) -> object:
                return inner(self, *args)

            cls.forward = wrapped  # type: ignore[method-assign]

    class Layer(Wrapping):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    layer = Layer()
    swap_forward(layer, lambda self, x: stock_forward(self, "_stock", x) * 2, "_stock")
    assert swapped(layer) and float(layer(torch.zeros(()))) == 2.0
    assert restore_class(layer) and type(layer) is Layer and float(layer(torch.zeros(()))) == 1.0
