"""Function surgery for patched forwards: compare a function with a template by bytecode, copy a
function with other globals, and swap the function under a chain of ``functools.wraps`` wrappers."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any


def same_code(fn: Any, template: Callable[..., Any]) -> bool:
    """Whether function ``fn`` has ``template``'s bytecode, names and arguments (annotations and
    docstrings aside)."""
    code, want = getattr(fn, "__code__", None), template.__code__
    star_args = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS  # (the other flags: __future__ imports, ...)
    return (
        code is not None
        and code.co_flags & star_args == want.co_flags & star_args
        and all(getattr(code, a) == getattr(want, a) for a in ("co_code", "co_names", "co_varnames", "co_argcount"))
    )


def rewrapped(outer: Any, new_inner: Callable[..., Any]) -> Callable[..., Any] | None:
    """``outer`` with the function at the bottom of its ``__wrapped__`` chain replaced by
    ``new_inner``: each wrapper (a closure over the function it wraps, as ``functools.wraps``
    decorators make) is copied with that closure cell pointing at the new function below it. So a
    patched forward keeps ``transformers``' decorators (its renamed-argument deprecation, say).
    None where a wrapper holds what it wraps some other way (then nothing is patched)."""
    wrapped = getattr(outer, "__wrapped__", None)
    if wrapped is None:
        return new_inner
    below = rewrapped(wrapped, new_inner)
    if below is None or not isinstance(outer, types.FunctionType):
        return None
    found = False
    new_cells = []
    for cell in outer.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            held = None
        if held is wrapped:
            found = True
            new_cells.append(types.CellType(below))
        else:
            new_cells.append(cell)
    if not found:
        return None
    fn = function_copy(outer, outer.__globals__, tuple(new_cells))
    fn.__dict__.update(outer.__dict__)
    fn.__wrapped__ = below
    fn.__module__ = outer.__module__
    return fn


def function_copy(fn: types.FunctionType, globals_: dict[str, Any], closure: tuple[Any, ...] | None) -> Any:
    """``fn`` with other globals or closure cells: the same code, name, defaults, qualified name
    and docstring."""
    copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return copy
