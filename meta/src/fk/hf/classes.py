"""Patch a model family's classes before construction: :func:`patch_classes` / :func:`unpatch_classes`.

The family's modeling module is the one that defines its causal LM in transformers' own registry
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``). Every ``transformers.PreTrainedModel`` subclass defined there
(``LlamaModel``, ``LlamaForCausalLM``, ``LlamaForSequenceClassification``, ...) gets a class-level
``__init__`` that runs the original one and then :func:`fk.hf.patcher.apply_patch` on the new
instance, so every model of the family built afterwards (``from_config``, ``from_pretrained``,
direct construction) comes out patched. A model built inside another one of the same family
(``LlamaModel`` in ``LlamaForCausalLM``) is patched once, by the outermost constructor.
:func:`unpatch_classes` restores the classes; models already built stay patched (revert them one by
one with :func:`fk.hf.revert`).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from typing import Any

from fk.hf.patcher import apply_patch

_SAVED: dict[str, list[tuple[type, Any]]] = {}
"""model type -> (class, its own ``__init__`` before patching or :data:`_INHERITED`), per class."""
_INHERITED = object()
_BUILDING = threading.local()
"""``depth``: model type -> how many constructors of that family are running in this thread."""


def causal_lm_types() -> dict[str, str]:
    """transformers' causal-LM registry: model type -> the name of its causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def modeling_module(model_type: str) -> str:
    """The module that defines ``model_type``'s causal LM (``"transformers.models.llama.modeling_llama"``);
    ``ValueError`` for a model type that is not in transformers' causal-LM registry."""
    import transformers

    name = causal_lm_types().get(model_type)
    if name is None:
        raise ValueError(
            f"{model_type!r} is not a causal-LM model type of transformers {transformers.__version__} "
            "(see fk.hf.supported_model_types())"
        )
    return str(getattr(transformers, name).__module__)


def family_classes(model_type: str) -> list[type]:
    """The ``PreTrainedModel`` subclasses defined in ``model_type``'s modeling module, by name."""
    from transformers import PreTrainedModel

    module = importlib.import_module(modeling_module(model_type))
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == module.__name__
    ]
    return sorted(found, key=lambda c: c.__name__)


def _patched_init(original: Callable[..., None], model_type: str, switches: dict[str, bool]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        depth: dict[str, int] = _BUILDING.__dict__.setdefault("depth", {})
        outer = depth.get(model_type, 0)
        depth[model_type] = outer + 1
        try:
            original(self, *args, **kwargs)
        finally:
            depth[model_type] = outer
        if outer == 0:
            apply_patch(self, switches)

    return __init__


def patch_classes(model_type: str, switches: dict[str, bool]) -> list[str]:
    """Make every model of ``model_type``'s family built from now on come out patched with ``switches``.

    Patching a family already patched replaces the previous switches. Returns the names of the
    classes patched.
    """
    unpatch_classes(model_type)
    classes = family_classes(model_type)
    originals = [(cls, cls.__init__) for cls in classes]  # type: ignore[misc]  # before any is replaced
    saved = _SAVED.setdefault(model_type, [])
    for cls, original in originals:
        saved.append((cls, cls.__dict__.get("__init__", _INHERITED)))
        cls.__init__ = _patched_init(original, model_type, dict(switches))  # type: ignore[misc]
    return [cls.__name__ for cls in classes]


def unpatch_classes(model_type: str) -> int:
    """Restore the classes :func:`patch_classes` patched for ``model_type``; returns how many."""
    modeling_module(model_type)  # (a ValueError for what is no model type)
    saved = _SAVED.pop(model_type, [])
    for cls, previous in saved:
        if previous is _INHERITED:
            del cls.__init__  # type: ignore[misc]
        else:
            cls.__init__ = previous  # type: ignore[misc]
    return len(saved)


def patched_classes() -> dict[str, list[str]]:
    """The families whose classes are patched now, each with its class names."""
    return {model_type: [cls.__name__ for cls, _ in saved] for model_type, saved in sorted(_SAVED.items())}
