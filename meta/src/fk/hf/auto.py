"""``fk.hf.AutoModelForCausalLM``: ``transformers.AutoModelForCausalLM`` whose models come patched."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class AutoModelForCausalLM:
    """Loads or builds a causal LM with ``transformers.AutoModelForCausalLM`` and patches it with
    :func:`fk.hf.apply` before returning it.

    ``from_pretrained`` and ``from_config`` take the same arguments as transformers' and one more
    keyword, ``fk_options``: a mapping of :func:`fk.hf.apply`'s switches (``{"flce": False}``;
    every switch not given is on). The switches are a separate mapping, not keywords of their
    own, because ``from_pretrained`` hands unknown keywords on to the model's config. An unknown
    switch raises ``TypeError`` before anything is loaded. Any model type is taken: what fk
    cannot patch stays stock (see :func:`fk.hf.apply`'s report).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise OSError(
            "fk.hf.AutoModelForCausalLM is not instantiated: use AutoModelForCausalLM.from_pretrained(...) or "
            "AutoModelForCausalLM.from_config(...)"
        )

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, *model_args: Any, fk_options: Mapping[str, bool] | None = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """``transformers.AutoModelForCausalLM.from_pretrained(...)``, patched with ``fk_options``.
        With ``output_loading_info=True`` the returned model (first of the pair) is patched."""
        import transformers

        from fk.hf import apply
        from fk.hf.switches import check_switches

        switches = check_switches(dict(fk_options or {}))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        apply(loaded[0] if isinstance(loaded, tuple) else loaded, **switches)
        return loaded

    @classmethod
    def from_config(cls, config: Any, *, fk_options: Mapping[str, bool] | None = None, **kwargs: Any) -> Any:
        """``transformers.AutoModelForCausalLM.from_config(config, ...)``, patched with ``fk_options``."""
        import transformers

        from fk.hf import apply
        from fk.hf.switches import check_switches

        switches = check_switches(dict(fk_options or {}))
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        apply(model, **switches)
        return model
