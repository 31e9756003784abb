"""Registering fk launchers as PyTorch custom ops, with a cheap eager path.

Every fk launcher (a Python function that takes tensors, launches Triton kernels and returns
tensors) is registered with ``torch.library`` as a custom op with a fake (meta) implementation,
and a forward op gets its backward through ``register_autograd``. ``torch.compile(fullgraph=True)``
then traces through fk ops without graph breaks.

A custom op call costs tens to hundreds of microseconds of Python on the host (argument
normalization, alias checks), which is more than the whole kernel at small sizes. So
:func:`define_autograd_op` returns a function that uses the custom ops only while
``torch.compile`` traces, and in eager mode runs the *same* launchers and the *same* backward
through a plain ``torch.autograd.Function``. Both paths share every line of kernel and gradient
code; the tests run both.

The op namespace is derived from the defining module's import name (``fk.norms.rms_norm`` becomes
``fk_norms_rms_norm``), so a vendored copy of a package (imported under another name) registers
its own ops instead of clashing with an installed fk.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch


def op_namespace(module_name: str) -> str:
    """The ``torch.library`` namespace for ops defined in module ``module_name``.

    Every character that cannot stand in an identifier (dots, and the dashes of module names that
    pytest's importlib mode derives from paths) becomes an underscore.
    """
    return re.sub(r"\W", "_", module_name)


def define_op(
    module_name: str,
    name: str,
    impl: Callable[..., Any],
    *,
    fake: Callable[..., Any],
    mutates_args: Iterable[str] = (),
) -> Any:
    """Register ``impl`` as the custom op ``<namespace>::<name>`` with fake implementation ``fake``.

    ``impl`` must carry type annotations (``torch.library.custom_op`` builds the schema from
    them). Arguments that ``impl`` writes into must be listed in ``mutates_args``. Returns the op,
    which is called like ``impl`` and has ``register_autograd``.
    """
    op = torch.library.custom_op(f"{op_namespace(module_name)}::{name}", impl, mutates_args=tuple(mutates_args))
    op.register_fake(fake)
    return op


def fake_from(launcher: Callable[..., Any], outputs: Callable[..., Any]) -> Callable[..., Any]:
    """The fake implementation of ``launcher``'s op, without repeating its signature.

    The fake takes the op's arguments as the launcher does and calls ``outputs`` with those that
    ``outputs`` names (by the launcher's parameter names, as keywords): a fake names only what its
    outputs' shapes and dtypes depend on, and a launcher's long argument list is written once.
    """
    given = tuple(inspect.signature(launcher).parameters)
    wanted = tuple(inspect.signature(outputs).parameters)
    unknown = [name for name in wanted if name not in given]
    if unknown:
        raise TypeError(f"{outputs.__name__} names {unknown}, which {launcher.__name__} does not take")

    def fake(*args: Any, **kwargs: Any) -> Any:
        arguments = {**dict(zip(given[: len(args)], args, strict=True)), **kwargs}
        return outputs(**{name: arguments[name] for name in wanted})

    fake.__name__ = fake.__qualname__ = f"{launcher.__name__}_fake"
    return fake


def define_autograd_op(
    module_name: str,
    name: str,
    *,
    forward: Callable[..., Any],
    forward_fake: Callable[..., Any],
    backward_launcher: Callable[..., Any],
    backward_fake: Callable[..., Any],
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    backward: Callable[..., Any],
    forward_mutates_args: Iterable[str] = (),
    backward_mutates_args: Iterable[str] = (),
) -> Callable[..., Any]:
    """A differentiable fk op: ``<name>_fwd`` and ``<name>_bwd`` custom ops plus an eager path.

    - ``forward(*inputs)``: the forward launcher; ``forward_fake`` its fake implementation.
    - ``backward_launcher(...)``: the backward launcher; ``backward_fake`` its fake.
    - ``setup_context(ctx, inputs, output)``: saves what the backward needs (as in
      ``register_autograd``).
    - ``backward(run_backward, ctx, *grad_outputs)``: the gradient formula. It must launch the
      backward through ``run_backward`` (the custom op under ``torch.compile``, the launcher itself
      in eager mode) and return one gradient (or None) per input.

    Returns ``apply(*inputs)``, which calls the custom op while ``torch.compile`` traces and a
    plain ``torch.autograd.Function`` otherwise.
    """
    bwd_op = define_op(
        module_name, f"{name}_bwd", backward_launcher, fake=backward_fake, mutates_args=backward_mutates_args
    )
    fwd_op = define_op(module_name, f"{name}_fwd", forward, fake=forward_fake, mutates_args=forward_mutates_args)
    fwd_op.register_autograd(lambda ctx, *grads: backward(bwd_op, ctx, *grads), setup_context=setup_context)

    class Eager(torch.autograd.Function):
        # forward(ctx, ...) rather than a separate setup_context staticmethod: with the latter,
        # Function.apply binds default arguments through inspect.signature on every call, which
        # cost ~60 us of host time per call on an H100 machine (torch 2.11).
        @staticmethod
        def forward(ctx: Any, *inputs: Any) -> Any:
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return backward(backward_launcher, ctx, *grads)

    Eager.__name__ = Eager.__qualname__ = f"{name}_eager"

    def apply(*inputs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fwd_op(*inputs)
        return Eager.apply(*inputs)

    apply.fwd_op = fwd_op  # type: ignore[attr-defined]
    apply.bwd_op = bwd_op  # type: ignore[attr-defined]
    return apply


def mark_overwritten(result: torch.Tensor | None, source: torch.Tensor) -> None:
    """Bump ``source``'s version when ``result`` (a gradient, say) was written into its buffer.

    A use of ``source`` that another op saved for its backward, or a second backward through the
    op that wrote, then fails with PyTorch's "modified by an inplace operation" error instead of
    reading the written values as the saved ones.
    """
    if result is not None and result.numel() and result.data_ptr() == source.data_ptr():
        torch.autograd.graph.increment_version(source)
