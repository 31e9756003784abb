"""Registering fk launchers as PyTorch custom ops.

Every fk launcher (a Python function that takes tensors, launches Triton kernels and returns
tensors) is registered with ``torch.library`` as a custom op with a fake (meta) implementation,
and the forward op gets its backward through ``register_autograd``. ``torch.compile(fullgraph=True)``
then traces through fk ops without graph breaks, and autograd works in eager mode too.

The op namespace is derived from the defining module's import name (``fk.norms.rms_norm`` becomes
``fk_norms_rms_norm``), so a vendored copy of a package (imported under another name) registers
its own ops instead of clashing with an installed fk.

Use::

    rms_norm_fwd = define_op(__name__, "fwd", _rms_norm_fwd, fake=_rms_norm_fwd_fake)
    rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
"""

from __future__ import annotations

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
