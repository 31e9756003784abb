"""The attributes fk.hf leaves in a patched module's ``__dict__``: one name each, read by the modules
that patch (:mod:`fk.hf.patcher`), run (:mod:`fk.hf.blocks`, :mod:`fk.hf.decoder`,
:mod:`fk.hf.loss_head`) and undo a patch."""

from __future__ import annotations

KIND = "_fk_hf_kind"
"""The switch that patched the module (``"rms_norm"``, ``"flce"``, ...)."""
PLAN = "_fk_hf_plan"
"""What the module's fk forward needs to know about it (a plan of :mod:`fk.hf.recognize`)."""
STOCK = "_fk_hf_stock_forward"
"""The module class's forward function before patching (unbound: called with the running module,
see :func:`fk.core.forward.stock_forward`)."""
LORA = "_fk_hf_lora_report"
"""Attribute of a model :func:`fk.hf.patcher.apply_patch` ran :func:`fk.lora.patch` on: its report."""
LOSS_OPTIONS = "_fk_hf_loss_options"
"""Attribute of a causal LM: keyword arguments its fused loss passes on (see fk.hf.loss_options)."""
GROUP = "_fk_hf_projection_group"
"""Attribute of a projection the ``qkv`` switch patched: ``(its SharedInputGroup, its index there)``."""
RECOMPUTE = "_fk_hf_recompute_norms"
"""Attribute of a decoder layer the ``add_norm`` switch patched with ``recompute_norms`` on."""
SWITCHED_OFF = "_fk_hf_switched_off"
"""Attribute of a reverted module whose fk forward stays under another's wrapper, switched off."""

ALL = (KIND, PLAN, GROUP, RECOMPUTE)
"""What :func:`fk.hf.patcher.revert` removes from a module (besides the stock forward)."""
